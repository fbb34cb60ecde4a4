"""The Pallas kernels compiled on a GPU (not interpret mode), against their references.

Run on a GPU machine after any kernel change, and keep the log:
  JAX_PLATFORMS=cuda python -m pytest -q tests_gpu tests/test_gmm_kernels.py \
      2>&1 | tee experiments/results/gpu_tests_<gpu>.log
(tests/test_gmm_kernels.py then runs compiled too: off the CPU the kernels are not interpreted;
JAX_PLATFORMS overrides the CPU default that tests/conftest.py sets. The decode kernels' tests,
tests/test_skinny_matmul.py, test_decode_attention.py and test_decode_router.py, run compiled the
same way.)
These need a GPU, so the CPU suite (tests/) does not collect them.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax as sj
from sparsejax import permute
from sparsejax.activations import ACTIVATIONS
from sparsejax.kernels import gmm as G
from sparsejax.kernels.gmm import mosaic, mosaic_epilogue, op
from sparsejax.topology import make_topology

HOPPER = str(op._gpu_compute_capability()).startswith("9")
BACKENDS = ["triton", "mosaic"] if HOPPER else ["triton"]


def rel_err(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def assert_rows_match(out, ref, topo):
  """Equal to ref where gmm's output is defined (active blocks), with that region's rows that hold
  no token exactly zero; the rows of inactive blocks are left unwritten by the Hopper kernels."""
  written = np.asarray(G.reference.written_rows(topo))
  out = np.asarray(out.astype(jnp.float32))
  assert rel_err(out[written], np.asarray(ref, np.float32)[written]) < 1e-2
  assert np.all(out[written & ~np.asarray(G.reference.real_rows(topo))] == 0)


def routed_topology(key, tokens, experts, k, skew=0.0):
  logits = -skew * jnp.log(jnp.arange(1, experts + 1, dtype=jnp.float32))
  ids = jax.lax.top_k(jax.random.gumbel(key, (tokens, experts)) + logits, k)[1].astype(jnp.int32)
  plc = permute.dropless_placement(ids, experts, block_size=128)
  return make_topology(plc.group_sizes, plc.num_rows, 128, plc.tokens_per_expert), ids


# (tokens, d, f, experts, k, skew): the small sibling shapes, one expert, all on one expert
SHAPES = [(4096, 1024, 2048, 64, 1, 0.0), (4096, 512, 1536, 8, 2, 0.5), (1000, 384, 640, 1, 1, 0.0),
          (2048, 256, 512, 16, 1, 40.0)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_compiled_match_reference(backend, shape):
  T, d, f, E, k, skew = shape
  keys = jax.random.split(jax.random.key(T + E), 5)
  topo, _ = routed_topology(keys[0], T, E, k, skew)
  rows = topo.num_row_blocks * 128
  x = jax.random.normal(keys[1], (rows, d), jnp.bfloat16)
  w = (jax.random.normal(keys[2], (E, d, f)) / d**0.5).astype(jnp.bfloat16)
  ct = jax.random.normal(keys[3], (rows, f), jnp.float32)
  for out_dtype in (jnp.bfloat16, jnp.float32):
    out = jax.jit(lambda a, b: G.gmm(a, b, topo, backend=backend, out_dtype=out_dtype))(x, w)
    assert out.dtype == out_dtype
    assert_rows_match(out, G.gmm_reference(x, w, topo), topo)
  # The loss reads the defined rows only, as every gather by real rows does.
  written = G.reference.written_rows(topo)[:, None]
  loss = lambda fn: lambda a, b: jnp.sum(jnp.where(written, fn(a, b).astype(jnp.float32), 0.0) * ct)
  g = jax.jit(jax.grad(loss(lambda a, b: G.gmm(a, b, topo, backend=backend)), argnums=(0, 1)))(x, w)
  g_ref = jax.jit(jax.grad(loss(lambda a, b: G.gmm_reference(a, b, topo)), argnums=(0, 1)))(x, w)
  assert_rows_match(g[0], g_ref[0], topo)
  assert rel_err(g[1], g_ref[1]) < 1e-2


@pytest.mark.parametrize("impl", ["pallas"] + BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_moe_mlp_compiled_matches_reference(impl, dtype):
  """moe_mlp's value and three gradients against the reference impl; float16 is what --dtype float16 trains in."""
  T, d, f, E, k = 2048, 256, 512, 16, 2
  keys = jax.random.split(jax.random.key(1), 5)
  x = jax.random.normal(keys[0], (T, d), dtype)
  ids = jax.lax.top_k(jax.random.gumbel(keys[1], (T, E)), k)[1].astype(jnp.int32)
  cw = jax.nn.softmax(jax.random.normal(keys[2], (T, k)), axis=-1)
  w_in = (jax.random.normal(keys[3], (E, d, f)) / d**0.5).astype(dtype)
  w_out = (jax.random.normal(keys[4], (E, f, d)) / f**0.5).astype(dtype)
  fn = lambda x, wi, wo, impl: jnp.sum(jnp.sin(sj.moe_mlp(x, ids, cw.astype(x.dtype), wi, wo, impl=impl)[0].astype(jnp.float32)))
  val, g = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)), static_argnums=3)(x, w_in, w_out, impl)
  val_r, g_r = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)), static_argnums=3)(x, w_in, w_out, "reference")
  tol = 1e-4 if dtype == jnp.float32 else 1e-2
  assert abs(float(val) - float(val_r)) <= tol * max(1.0, abs(float(val_r)))
  for a, b in zip(g, g_r):
    assert rel_err(a, b) < tol


def _check_expert_mlp_compiled(backend, act, shape, glu):
  """expert_mlp (with glu, the gated form) against the float32 reference, values and gradients."""
  T, d, f, E, k, skew = shape
  n_in = 2 if glu else 1  # (w_gate,) w_in
  keys = jax.random.split(jax.random.key(T + E + 1 + glu), 4 + n_in)
  topo, _ = routed_topology(keys[0], T, E, k, skew)
  rows = topo.num_row_blocks * 128
  fn = ACTIVATIONS[act]
  x = jax.random.normal(keys[1], (rows, d), jnp.bfloat16)
  w_first = [(jax.random.normal(kk, (E, d, f)) / d**0.5).astype(jnp.bfloat16) for kk in keys[2:2 + n_in]]
  w_out = (jax.random.normal(keys[2 + n_in], (E, f, d)) / f**0.5).astype(jnp.bfloat16)
  ct = jax.random.normal(keys[3 + n_in], (rows, d), jnp.float32)
  args = (x, *w_first, w_out)
  gate = lambda ws: ws[0] if glu else None
  mlp = lambda a, *ws: G.expert_mlp(a, ws[-2], ws[-1], topo, activation=fn, backend=backend, w_gate=gate(ws))
  ref = lambda a, *ws: G.mlp_reference(a, ws[-2], ws[-1], topo, fn, w_gate=gate(ws))
  y = jax.jit(mlp)(*args)
  assert y.dtype == jnp.bfloat16
  assert_rows_match(y, ref(*args), topo)
  written = G.reference.written_rows(topo)[:, None]
  loss = lambda m: lambda *a: jnp.sum(jnp.where(written, m(*a).astype(jnp.float32), 0.0) * ct)
  argnums = tuple(range(len(args)))
  g = jax.jit(jax.grad(loss(mlp), argnums=argnums))(*args)
  g_ref = jax.jit(jax.grad(loss(ref), argnums=argnums))(*args)
  assert_rows_match(g[0], g_ref[0], topo)
  for a, b in zip(g[1:], g_ref[1:], strict=True):
    assert rel_err(a, b) < 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ["gelu", "silu"] + (["gelu_exact", "relu"] if HOPPER else []))
@pytest.mark.parametrize("shape", SHAPES)
def test_expert_mlp_compiled_matches_reference(backend, act, shape):
  """The expert MLP op (on Hopper: the activation and its derivative in the kernels' epilogues)."""
  _check_expert_mlp_compiled(backend, act, shape, glu=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("shape", SHAPES)
def test_glu_expert_mlp_compiled_matches_reference(backend, act, shape):
  """The GLU expert MLP (act(x W_gate) * x W_in) W_out (on Hopper: gmm_glu and gmm_dglu, the
  product and its derivatives in the epilogues), all four gradients."""
  _check_expert_mlp_compiled(backend, act, shape, glu=True)


@pytest.mark.parametrize("act", ["gelu", "silu"] if HOPPER else [])
@pytest.mark.parametrize("shape", SHAPES)
def test_mosaic_epilogue_warpgroup_compiled_matches_reference(monkeypatch, act, shape):
  """gmm_act and gmm_dact with the epilogue in a fourth warpgroup (mosaic_epilogue.CONFIGS, the
  ring and staging buffers at their compiled depths) through the expert MLP."""
  monkeypatch.setattr(mosaic, "DEFAULT_CONFIGS",
                      dataclasses.replace(mosaic.DEFAULT_CONFIGS, **mosaic_epilogue.CONFIGS))
  _check_expert_mlp_compiled("mosaic", act, shape, glu=False)


@pytest.mark.parametrize("act", ["gelu", "silu"] if HOPPER else [])
def test_expert_mlp_compiled_with_long_experts(act):
  """Experts of LONG_ROWS rows or more: the defaults run gmm_act with the epilogue warpgroup
  (Configs.gmm_act_long) and tgmm_long, through the expert MLP."""
  shape = (8192, 256, 384, 2, 1, 0.0)
  topo, _ = routed_topology(jax.random.key(0), *shape[:1], *shape[3:])
  assert mosaic.DEFAULT_CONFIGS.gmm_for("gmm_act", topo.num_row_blocks * 128, topo.num_experts).epilogue_wg
  _check_expert_mlp_compiled("mosaic", act, shape, glu=False)


# tgmm's schedules: the per-tile pipeline, the ping-pong one (mosaic_pingpong.py), one ring for all
# of a CTA's tiles with each consumer's whole tile staged for its stores (_tgmm_streamed).
TGMM_SCHEDULES = {"per_tile": dict(streamed=False, pingpong=False),
                  "pingpong": dict(streamed=False, pingpong=True),
                  "streamed": dict(streamed=True, pingpong=False, max_concurrent_steps=3, epi_slots=4)}


@pytest.mark.parametrize("schedule", list(TGMM_SCHEDULES) if HOPPER else [])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", SHAPES + [(8192, 256, 384, 2, 1, 0.0)])  # the last takes tgmm_long
def test_mosaic_tgmm_compiled_matches_reference(shape, out_dtype, schedule):
  """tgmm alone, on each schedule, against the float32 reference, bf16 and float32 gradients; an
  expert with no rows (the skewed shape has some) gets an exact zero gradient."""
  cfgs = mosaic.DEFAULT_CONFIGS.with_tgmm(**TGMM_SCHEDULES[schedule])
  T, d, f, E, k, skew = shape
  keys = jax.random.split(jax.random.key(T + E + 7), 3)
  topo, _ = routed_topology(keys[0], T, E, k, skew)
  rows = topo.num_row_blocks * 128
  # Random on the padding rows too: only the tail mask keeps an expert's last partial step's
  # padding out of its gradient.
  x = jax.random.normal(keys[1], (rows, d), jnp.bfloat16)
  dh = jax.random.normal(keys[2], (rows, f), jnp.bfloat16)
  dw = jax.jit(lambda a, b: mosaic.tgmm(a, b, topo, out_dtype, cfgs))(x, dh)
  assert dw.dtype == out_dtype and dw.shape == (E, d, f)
  assert rel_err(dw, G.tgmm_reference(x, dh, topo, jnp.float32)) < 1e-2
  empty = np.asarray(topo.expert_block_offsets[1:] == topo.expert_block_offsets[:-1])
  assert np.all(np.asarray(dw)[empty] == 0)


@pytest.mark.parametrize("expert_bands", [True, False] if HOPPER else [])
@pytest.mark.parametrize("shape", SHAPES)
def test_expert_mlp_compiled_in_either_tile_order(monkeypatch, shape, expert_bands):
  """Every gmm kind in expert_band_order and in planar_snake order, through the expert MLP and its
  GLU form, against the float32 reference. The tail split cuts the band order's last wave, so
  planar order turns it off (gmm and gmm_t refuse split_tail without expert_bands)."""
  kinds = ("gmm", "gmm_t", "gmm_act", "gmm_dact", "gmm_glu", "gmm_glu_short", "gmm_dglu")
  d = mosaic.DEFAULT_CONFIGS
  monkeypatch.setattr(mosaic, "DEFAULT_CONFIGS", dataclasses.replace(d, **{
      k: dataclasses.replace(getattr(d, k), expert_bands=expert_bands,
                             split_tail=getattr(d, k).split_tail and expert_bands) for k in kinds}))
  _check_expert_mlp_compiled("mosaic", "gelu", shape, glu=False)
  _check_expert_mlp_compiled("mosaic", "silu", shape, glu=True)


# The one-weight gmm kinds on the ping-pong schedule (mosaic_pingpong.gmm_padded: gmm_act's and
# gmm_dact's default; gmm and gmm_t too here) and gmm_act / gmm_dact on the cooperative one.
_PINGPONG = mosaic.Config(pingpong=True, tile_n=128, max_concurrent_steps=6, epi_tile_n=32,
                          grid_tile_width=8, expert_bands=True)
GMM_SCHEDULES = {"pingpong": dict(gmm=_PINGPONG, gmm_t=_PINGPONG, gmm_act=_PINGPONG, gmm_dact=_PINGPONG),
                 "cooperative": dict(gmm_act=mosaic.COOPERATIVE_ACT, gmm_dact=mosaic.COOPERATIVE_DACT)}


@pytest.mark.parametrize("schedule", list(GMM_SCHEDULES) if HOPPER else [])
@pytest.mark.parametrize("shape", SHAPES)
def test_gmm_schedules_compiled_match_reference(monkeypatch, shape, schedule):
  """Each gmm schedule through the expert MLP (values and gradients against the float32
  reference) and the plain gmm with its gradients (test_kernels_compiled_match_reference)."""
  monkeypatch.setattr(mosaic, "DEFAULT_CONFIGS",
                      dataclasses.replace(mosaic.DEFAULT_CONFIGS, **GMM_SCHEDULES[schedule]))
  _check_expert_mlp_compiled("mosaic", "gelu", shape, glu=False)
  test_kernels_compiled_match_reference("mosaic", shape)
