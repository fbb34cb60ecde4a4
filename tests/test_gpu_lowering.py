"""The Pallas Triton kernels lower for a GPU, checked from the CPU.

Interpret mode runs a kernel's jaxpr with XLA's CPU ops, so it cannot tell whether Triton lowers every
primitive a kernel body uses (a sort, an erf, a reshape of a loaded block would pass here and fail on
the first GPU call). jax lowers for a platform it does not run on (lowering_platforms), so each kernel
is lowered for CUDA here; compiling and running them is tests_gpu/'s and the GPU runs of tests/.
"""
import jax
import jax.numpy as jnp
import pytest

from sparsejax.activations import PLAIN
from sparsejax.kernels.decode_attention import triton as attention
from sparsejax.kernels.decode_qkv import triton as qkv
from sparsejax.kernels.decode_router import triton as router
from sparsejax.kernels.row_moves import triton as row_moves
from sparsejax.kernels.skinny_matmul import triton as skinny
from sparsejax.rope import inverse_frequencies

bf16 = jnp.bfloat16


def _lowers(fn, *shapes):
  """fn lowers for CUDA with one Triton custom call or more."""
  args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") >= 1


def _hidden_ffn(m, d, f, act, gated, scaled):
  """W_in (and W_gate) as parts with the norm folded, then W_out taking them as its Hidden rows."""
  ci, co = skinny.default_config(m, d, f), skinny.default_config(m, f, d)
  hidden = skinny.Hidden(PLAIN[act], jnp.dtype(bf16), d // ci.rows_per_program, scaled, gated, scaled)

  def fn(x, g, w_in, w_gate, s, w_out, ids):
    first = lambda w: skinny.skinny_matmul_parts((x, g), skinny.Normed(1e-6), w, ids, m, bf16, ci, interpret=False)
    ops = (first(w_in),) + ((s,) if scaled else ())
    if gated:
      ops += (first(w_gate),) + ((s,) if scaled else ())
    return skinny.skinny_matmul_parts(ops, hidden, w_out, ids, m, bf16, co, interpret=False)

  wdt = jnp.int8 if scaled else bf16
  return fn, ((m, d), bf16), ((d,), jnp.float32), ((4, d, f), wdt), ((4, d, f), wdt), ((4, f), jnp.float32), \
      ((4, f, d), wdt), ((2,), jnp.int32)


@pytest.mark.parametrize("act", [jax.nn.gelu, jax.nn.silu, jax.nn.relu], ids=["gelu", "silu", "relu"])
@pytest.mark.parametrize("m,d,f", [(1, 1024, 4096), (1, 256, 512), (5, 256, 512)])
def test_skinny_ffn_kernels_lower(act, m, d, f):
  for gated, scaled in [(False, False), (True, True)]:
    fn, *shapes = _hidden_ffn(m, d, f, act, gated, scaled)
    _lowers(fn, *shapes)


@pytest.mark.parametrize("m", [1, 5])
def test_skinny_matmul_plain_rows_lower(m):
  cfg = skinny.default_config(m, 1024, 1024)
  for per_slot in (False, True):
    shape = (2, m, 1024) if per_slot else (m, 1024)
    fn = lambda x, w, ids: skinny.skinny_matmul_parts((x,), skinny.Plain(per_slot), w, ids, m, bf16, cfg,
                                                      interpret=False)
    _lowers(fn, (shape, bf16), ((4, 1024, 1024), bf16), ((2,), jnp.int32))


def test_decode_qkv_lowers():
  fn = lambda p, k, v, i, s: qkv.decode_qkv(p, k, v, i, s, inverse_frequencies(64, 1e4), bf16, interpret=False)
  _lowers(fn, ((8, 1, 3 * 16 * 64), jnp.float32), ((1, 160, 16, 64), bf16), ((1, 160, 16, 64), bf16),
          ((), jnp.int32), ((1,), jnp.int32))


def test_decode_attention_lowers():
  fn = lambda q, k, v, s, i: attention.chunk_attention(q, k, v, s, i, interpret=False)
  _lowers(fn, ((2, 16, 64), bf16), ((2, 160, 16, 64), bf16), ((2, 160, 16, 64), bf16), ((2,), jnp.int32),
          ((), jnp.int32))


@pytest.mark.parametrize("norm", [False, True])
def test_decode_router_lowers(norm):
  cfg = router.default_config(1024, 64)
  fn = lambda x, w, g: router.decode_router(x, w, 1, False, cfg, interpret=False, norm=(g, 1e-6) if norm else None)
  _lowers(fn, ((1, 1024), bf16), ((1024, 64), jnp.float32), ((1024,), jnp.float32))


def test_row_gather_lowers():
  _lowers(lambda x, src: row_moves.gather_rows(x, src, interpret=False), ((512, 256), bf16), ((640,), jnp.int32))
