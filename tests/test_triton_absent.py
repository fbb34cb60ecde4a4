"""Where the Triton kernels cannot run, "auto" takes the XLA paths: a jax without Pallas' Triton backend (deprecated
in JAX 0.11 for removal), or a GPU before sm_80 (no bf16 tensor cores: T4, V100).

The absent backend is simulated in a child process (this file run as a script), so no module state leaks into
the other tests: its modules are set to None in sys.modules before sparsejax is imported. The child runs the
ops end to end on the CPU, then asks the GPU's "auto" decisions with jax.default_backend patched to "gpu", and
prints what it saw as JSON. In this process the backend is there, and the same decisions take the kernels.
"""
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# What a jax without the backend lacks: the public module, Pallas' lowering package and jaxlib's dialect.
ABSENT = ("jax.experimental.pallas.triton", "jax._src.pallas.triton", "jax._src.pallas.triton.lowering",
          "jax._src.pallas.triton.core", "jax._src.pallas.triton.pallas_call_registration", "jax._src.lib.triton")
NO_TRITON = "no Pallas Triton backend"
# Each decode-side kernel's "does auto run it" answer, all False: where none runs.
_NO_KERNELS = {name: False for name in ("decode_qkv", "row_moves", "group_rows", "decode_router", "splits_logits",
                                        "skinny_matmul", "folds_norm", "fuses_hidden", "runs_row_ffn",
                                        "fuses_residual", "decode_attention")}


def _gpu_decisions(monkeypatch_setattr, cc: str) -> dict:
  """The GPU's "auto" choices for shapes every kernel takes, with jax.default_backend() "gpu" of compute capability
  cc ("9.0": Hopper)."""
  import sparsejax.kernels
  from sparsejax.grouped_matmul import resolve_impl
  from sparsejax.kernels import decode_qkv, decode_router, group_rows, row_moves, skinny_matmul
  from sparsejax.kernels.gmm import op as gmm_op

  monkeypatch_setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch_setattr(gmm_op, "_gpu_compute_capability", lambda: cc)
  monkeypatch_setattr(sparsejax.kernels, "gpu_compute_capability", lambda: cc)
  f32, bf16 = jnp.float32, jnp.bfloat16
  return {
      "decode_qkv": decode_qkv.runs_kernel(64),
      "row_moves": row_moves.runs_kernel(1024),
      "group_rows": group_rows.runs_kernel(32, 64, 1024),
      "decode_router": decode_router.runs_kernel(1, 1024, 64, 2),
      "splits_logits": decode_router.splits_logits(1, 1024, 64, 2),
      "skinny_matmul": skinny_matmul.runs_kernel(1, 1024, 4096),
      "folds_norm": skinny_matmul.folds_norm(1, 1024, 4096),
      "fuses_hidden": skinny_matmul.fuses_hidden(1, 1024, 4096, jax.nn.gelu),
      "runs_row_ffn": skinny_matmul.runs_row_ffn(1, 1024, 4096, jax.nn.silu),
      "fuses_residual": skinny_matmul.fuses_residual(1, 1024, 4096, jax.nn.silu),
      # a new function each time: make_jaxpr caches its trace per function, and the choice happens while tracing
      "decode_attention": "pallas_call" in str(jax.make_jaxpr(lambda *a: _attention(*a))(*_attention_args())),
      "impl_auto": resolve_impl("auto"),
      "impl_auto_f32": resolve_impl("auto", f32),
      "impl_auto_bf16": resolve_impl("auto", bf16),
      "gmm_auto": gmm_op.resolve_backend("auto"),
      "gmm_auto_f32": gmm_op.resolve_backend("auto", f32),
      "gmm_mosaic_f32": gmm_op.resolve_backend("mosaic", f32),
      "moe_f32": _moe_impl(monkeypatch_setattr, f32),
      "moe_bf16": _moe_impl(monkeypatch_setattr, bf16),
  }


class _Resolved(Exception):
  pass


def _moe_impl(monkeypatch_setattr, dtype) -> str:
  """The impl moe_mlp's dropless layer resolves "auto" to for rows and weights of dtype (the call stops there)."""
  from sparsejax import moe
  from sparsejax.grouped_matmul import resolve_impl

  def stop(*args):
    raise _Resolved(resolve_impl(*args))

  monkeypatch_setattr(moe, "resolve_impl", stop)
  x, w_in, w_out = jnp.ones((4, 16), dtype), jnp.ones((2, 16, 32), dtype), jnp.ones((2, 32, 16), dtype)
  try:
    moe.moe_mlp(x, jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1), dtype), w_in, w_out)
  except _Resolved as e:
    return e.args[0]
  raise AssertionError("moe_mlp did not resolve its impl")


def _attention(q, k, v, start, index):
  from sparsejax.kernels.decode_attention import decode_attention
  return decode_attention(q, k, v, start, index)


def _attention_args():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, 2, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((2, 16, 2, 16)), jnp.float32) for _ in range(2))
  return q, k, v, jnp.array([0, 3], jnp.int32), jnp.int32(5)


def _error(fn) -> str | None:
  """fn's error as 'Type: message', or None where it returns."""
  try:
    fn()
  except Exception as e:  # noqa: BLE001 - the type is part of the answer
    return f"{type(e).__name__}: {e}"
  return None


def _end_to_end() -> dict:
  """Each op on the CPU's "auto" (its XLA path) against its reference: the largest difference."""
  from sparsejax.grouped_matmul import grouped_matmul, grouped_matmul_reference
  from sparsejax.kernels import decode_qkv, decode_router, gmm, row_moves, skinny_matmul
  from sparsejax.kernels.decode_attention import decode_attention_reference
  from sparsejax.topology import make_topology

  rng = np.random.default_rng(1)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  gap = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))  # on the host
  out = {"decode_attention": gap(_attention(*_attention_args()), decode_attention_reference(*_attention_args()))}
  parts, kc, vc = draw(1, 2, 3 * 2 * 16), draw(2, 16, 2, 16), draw(2, 16, 2, 16)
  start, index = jnp.zeros((2,), jnp.int32), jnp.int32(3)
  got = decode_qkv.decode_qkv(parts, kc, vc, index, start, rope_base=1e4, dtype=jnp.float32)
  want = decode_qkv.decode_qkv_reference(parts, kc, vc, index, start, 1e4, jnp.float32)
  out["decode_qkv"] = max(gap(a, b) for a, b in zip(got, want))
  x, w_in, w_out = draw(1, 32), draw(32, 64), draw(64, 32)
  out["skinny_matmul"] = gap(skinny_matmul.skinny_matmul(x, w_in), x @ w_in)
  out["skinny_ffn"] = gap(skinny_matmul.skinny_ffn(x, w_in, w_out), jax.nn.gelu(x @ w_in) @ w_out)
  xr, wr = draw(2, 32), draw(32, 8)
  out["decode_router"] = max(gap(a, b) for a, b in zip(decode_router.decode_router(xr, wr, 2),
                                                       decode_router.decode_router_reference(xr, wr, 2, True)))
  rp = draw(1, 2, 8)
  out["select_logit_parts"] = max(gap(a, b) for a, b in zip(decode_router.select_logit_parts(rp, 2),
                                                            decode_router.select_from_parts(rp, 2, True)))
  xs, src = draw(4, 16), jnp.array([0, 4, 2], jnp.int32)
  out["gather_rows"] = gap(row_moves.gather_rows(xs, src), row_moves.gather_rows_reference(xs, src))
  lhs, rhs, sizes = draw(40, 16), draw(3, 16, 24), jnp.array([10, 0, 25], jnp.int32)
  want = grouped_matmul_reference(lhs, rhs, sizes)
  out["grouped_matmul"] = gap(grouped_matmul(lhs, rhs, sizes), want)
  out["grouped_matmul_mosaic_f32"] = gap(grouped_matmul(lhs, rhs, sizes, impl="mosaic"), want)  # Mosaic's float32
  topo = make_topology(jnp.array([128, 0, 128]), 3 * 128, 128, sizes)
  rows, dout = draw(3 * 128, 16), draw(3 * 128, 24)
  out["gmm"] = gap(gmm.gmm(rows, rhs, topo), gmm.gmm_reference(rows, rhs, topo))
  out["tgmm"] = gap(gmm.tgmm(rows, dout, topo), gmm.tgmm_reference(rows, dout, topo))
  return out


def _explicit_triton_errors() -> dict:
  """Each explicit Triton impl's error where the backend is absent."""
  from sparsejax.grouped_matmul import grouped_matmul
  from sparsejax.kernels import decode_qkv, decode_router, gmm, row_moves, skinny_matmul
  from sparsejax.kernels.decode_attention import decode_attention
  from sparsejax.topology import make_topology

  x, w = jnp.ones((1, 32)), jnp.ones((32, 64))
  q, k, v, start, index = _attention_args()
  lhs, rhs, sizes = jnp.ones((8, 16)), jnp.ones((2, 16, 16)), jnp.array([3, 5], jnp.int32)
  topo = make_topology(jnp.array([128, 0]), 128, 128)
  return {
      "decode_attention": _error(lambda: decode_attention(q, k, v, start, index, impl="triton")),
      "decode_qkv": _error(lambda: decode_qkv.decode_qkv(jnp.ones((1, 2, 96)), k, v, index, start, rope_base=1e4,
                                                         dtype=jnp.float32, impl="triton")),
      "skinny_matmul": _error(lambda: skinny_matmul.skinny_matmul(x, w, impl="triton")),
      "decode_router": _error(lambda: decode_router.decode_router(x, jnp.ones((32, 8)), 2, impl="triton")),
      "router_logit_parts": _error(lambda: decode_router.router_logit_parts(jnp.ones((1, 1024)),
                                                                            jnp.ones((1024, 64)))),
      "gather_rows": _error(lambda: row_moves.gather_rows(x, jnp.array([0]), impl="triton")),
      "grouped_matmul_triton": _error(lambda: grouped_matmul(lhs, rhs, sizes, impl="triton")),
      "grouped_matmul_pallas": _error(lambda: grouped_matmul(lhs, rhs, sizes, impl="pallas")),
      "gmm_triton": _error(lambda: gmm.gmm(jnp.ones((128, 16)), rhs, topo, backend="triton")),
  }


def _child() -> dict:
  """The checks, run where ABSENT's modules cannot be imported."""
  for name in ABSENT:
    sys.modules[name] = None
  import sparsejax  # noqa: F401
  from sparsejax.kernels import pallas_triton_available
  from sparsejax.kernels.gmm import mosaic  # noqa: F401 - the Hopper kernels' module imports all the same

  result = {"available": pallas_triton_available()}
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    result["end_to_end"] = _end_to_end()
    result["errors"] = _explicit_triton_errors()
    count = lambda: sum(NO_TRITON in str(m.message) and m.category is RuntimeWarning for m in seen)
    result["warnings_on_cpu"] = count()
    result["gpu"] = _gpu_decisions(setattr, "8.0")
    result["hopper"] = _gpu_decisions(setattr, "9.0")
    result["warnings_on_gpu"] = count()
  return result


def _run_child() -> dict:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  # The child's sys.path starts at tests/, so a checkout that is not pip-installed (a GPU machine) needs the root.
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
  r = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, env=env,
                     cwd=root, timeout=300)
  assert r.returncode == 0, r.stderr[-4000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_backend_is_there_and_auto_takes_its_kernels_on_a_gpu(monkeypatch):
  from sparsejax.kernels import pallas_triton_available
  assert pallas_triton_available()
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)  # no fallback warning where the kernels run
    gpu = _gpu_decisions(monkeypatch.setattr, "8.0")
    hopper = _gpu_decisions(monkeypatch.setattr, "9.0")
  kernels = dict.fromkeys(_NO_KERNELS, True)
  assert gpu == dict(kernels, impl_auto="pallas", impl_auto_f32="pallas", impl_auto_bf16="pallas",
                     gmm_auto="triton", gmm_auto_f32="triton", gmm_mosaic_f32="mosaic", moe_f32="pallas",
                     moe_bf16="pallas")
  assert hopper == dict(kernels, impl_auto="pallas", impl_auto_f32="pallas", impl_auto_bf16="pallas",
                        gmm_auto="mosaic", gmm_auto_f32="mosaic", gmm_mosaic_f32="mosaic", moe_f32="pallas",
                        moe_bf16="pallas")


@pytest.mark.parametrize("cc", ["7.5", "7.0"])
def test_before_sm80_auto_takes_xla_with_one_warning_and_an_explicit_triton_runs_the_kernels(monkeypatch, cc):
  import sparsejax.kernels
  from sparsejax.grouped_matmul import resolve_impl
  from sparsejax.kernels.gmm import op as gmm_op

  sparsejax.kernels._warn_before_ampere.cache_clear()
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    got = _gpu_decisions(monkeypatch.setattr, cc)
    got_again = _gpu_decisions(monkeypatch.setattr, cc)
    explicit = (resolve_impl("triton"), resolve_impl("triton", jnp.float32), gmm_op.resolve_backend("triton"))
  assert got == got_again == dict(_NO_KERNELS, impl_auto="ragged_dot", impl_auto_f32="ragged_dot",
                                  impl_auto_bf16="ragged_dot", gmm_auto="xla", gmm_auto_f32="xla",
                                  gmm_mosaic_f32="xla", moe_f32="ragged_dot", moe_bf16="ragged_dot")
  assert explicit == ("triton", "triton", "triton")
  warned = [str(m.message) for m in seen if m.category is RuntimeWarning and "predates sm_80" in str(m.message)]
  assert len(warned) == 1 and f"compute capability {cc}" in warned[0] and "\n" not in warned[0], warned


@pytest.mark.parametrize("cc", ["8.6", "8.9", "10.0", "12.0"])
def test_from_sm80_auto_takes_the_triton_kernels_off_hopper(monkeypatch, cc):
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    got = _gpu_decisions(monkeypatch.setattr, cc)
  assert got == dict(dict.fromkeys(_NO_KERNELS, True), impl_auto="pallas", impl_auto_f32="pallas",
                     impl_auto_bf16="pallas", gmm_auto="triton", gmm_auto_f32="triton", gmm_mosaic_f32="mosaic",
                     moe_f32="pallas", moe_bf16="pallas")


def test_without_the_backend_auto_takes_xla_and_triton_is_a_one_line_error():
  got = _run_child()
  assert got["available"] is False
  for op, gap in got["end_to_end"].items():
    assert gap < 1e-4, (op, gap)
  for op, err in got["errors"].items():
    assert err is not None and err.startswith("RuntimeError: ") and NO_TRITON in err and "\n" not in err, (op, err)
  no_kernels = _NO_KERNELS
  # Off Hopper every Pallas choice is Triton's: XLA. On Hopper bf16 keeps Mosaic; float32, which Mosaic hands to
  # Triton, takes XLA: the MoE layer ragged_dot (it resolves with its dtype), a direct gmm call the padded "xla".
  assert got["gpu"] == dict(no_kernels, impl_auto="ragged_dot", impl_auto_f32="ragged_dot",
                            impl_auto_bf16="ragged_dot", gmm_auto="xla", gmm_auto_f32="xla", gmm_mosaic_f32="xla",
                            moe_f32="ragged_dot", moe_bf16="ragged_dot")
  assert got["hopper"] == dict(no_kernels, impl_auto="pallas", impl_auto_f32="ragged_dot", impl_auto_bf16="pallas",
                               gmm_auto="mosaic", gmm_auto_f32="xla", gmm_mosaic_f32="xla", moe_f32="ragged_dot",
                               moe_bf16="pallas")
  assert got["warnings_on_cpu"] == 0 and got["warnings_on_gpu"] == 1


if __name__ == "__main__":
  print(json.dumps(_child()))
