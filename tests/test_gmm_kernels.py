"""The grouped-GEMM kernels of every backend, in interpret mode on the CPU, against their reference.

The Triton backend runs every case in float32 and bf16. The Mosaic GPU (Hopper) backend is slower
to interpret, so two bf16 expert MLPs (plain and GLU) run all its kernels (gmm with each epilogue:
none, activation, GLU; gmm with the transposed weight with and without a derivative epilogue;
tgmm in both tile orders and on the ping-pong schedule) on shapes that cross several K and N tiles; its float32 calls are served
by the Triton backend. tests_gpu/ runs the same kernels compiled, at full size.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mosaic_interpret_compat
import sparsejax as sj
from sparsejax import kernels
from sparsejax.kernels import gmm as G
from sparsejax.kernels.gmm import mosaic, mosaic_epilogue
from sparsejax.topology import make_topology

mosaic_interpret_compat.install()
mosaic_interpret_compat.compile_thread_bodies_once()

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

# The references and row masks, jitted: one program each, not op by op.
gmm_reference = jax.jit(G.gmm_reference, static_argnames=("transpose_rhs", "out_dtype"))
tgmm_reference = jax.jit(G.tgmm_reference, static_argnames=("out_dtype",))
real_rows = jax.jit(G.reference.real_rows)
written_rows = jax.jit(G.reference.written_rows)
# The tests' topologies and random operands, likewise: op by op, each new shape compiled a dozen small programs.
_make_topology = jax.jit(make_topology, static_argnums=(1, 2))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal_draws(key, shapes, dtypes):
  """jax.random.normal of each shape in its dtype (dtypes: one for all, or one a shape), with the keys
  jax.random.split(key, len(shapes)): the draws op by op would give."""
  dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,) * len(shapes)
  return [jax.random.normal(k, s, t) for k, s, t in zip(jax.random.split(key, len(shapes)), shapes, dtypes)]


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def check_rows(out, ref, topo, tol):
  """out against ref on the rows where gmm's output is defined (active blocks), with the rows
  there that hold no token exactly zero. Rows of inactive blocks are unspecified (the interpreter
  leaves unwritten memory NaN, so a kernel that read them would fail the comparisons after it)."""
  written = np.asarray(written_rows(topo))
  real = np.asarray(real_rows(topo))
  out = np.asarray(out)
  assert rel_err(out[written], np.asarray(ref)[written]) < tol
  assert np.all(out[written & ~real] == 0)


def topology_for(group_sizes, num_rows_bound=None, block=128, real=True):
  """real=True: the topology knows each expert's real row count (its last block is part padding)."""
  gs = np.asarray(group_sizes)
  padded = (gs + block - 1) // block * block
  rows = num_rows_bound or int(padded.sum()) + block  # one spare block, inactive
  return _make_topology(jnp.asarray(padded, jnp.int32), rows, block,
                        jnp.asarray(gs, jnp.int32) if real else None)


# Group sizes (real rows before padding): empty experts, everything on one expert, sizes that are
# not multiples of the block, a single expert.
GROUPS = [
    [130, 0, 5, 200],
    [0, 0, 300, 0],
    [1, 1, 1, 1],
    [257],
]


def _operands(groups, dtype, k, n, seed, num_rows_bound=None):
  topo = topology_for(groups, num_rows_bound)
  rows = topo.num_row_blocks * topo.block_size
  e = len(groups)
  return (topo, *_normal_draws(jax.random.key(seed), ((rows, k), (e, k, n), (e, n, k), (rows, n)), dtype))


@jax.jit
def _triton_products(lhs, rhs, rhs_t, dout, topo):
  """gmm, the transposed gmm and tgmm on the Triton backend: one program, not op by op."""
  return (G.gmm(lhs, rhs, topo, backend="triton"), G.gmm(lhs, rhs_t, topo, transpose_rhs=True, backend="triton"),
          G.tgmm(lhs, dout, topo, backend="triton"))


# One row count for every grouping (the largest's active blocks and a spare one; the others have more
# inactive blocks), so that groupings of as many experts share their compiles.
GROUPS_ROWS = max(int(sum(-(-g // 128) * 128 for g in gs)) for gs in GROUPS) + 128


@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k,n", [(32, 48), (300, 330)])  # one tile; several K and N tiles
def test_triton_kernels_match_reference(groups, dtype, k, n):
  topo, lhs, rhs, rhs_t, dout = _operands(groups, dtype, k, n, hash((tuple(groups), k)) % 2**31, GROUPS_ROWS)
  rows = lhs.shape[0]
  out, out_t, dw = _triton_products(lhs, rhs, rhs_t, dout, topo)
  assert out.dtype == dtype and out.shape == (rows, n)
  check_rows(out, gmm_reference(lhs, rhs, topo), topo, TOL[dtype])
  # Beyond the shared contract, the Triton kernels write zeros in inactive blocks too (triton.py).
  assert np.all(np.asarray(out)[~np.asarray(real_rows(topo))] == 0)
  check_rows(out_t, gmm_reference(lhs, rhs_t, topo, transpose_rhs=True), topo, TOL[dtype])
  assert dw.shape == (len(groups), k, n)
  assert rel_err(dw, tgmm_reference(lhs, dout, topo)) < TOL[dtype]
  empty = [i for i, g in enumerate(groups) if g == 0]
  assert np.all(np.asarray(dw)[empty] == 0)


def test_triton_pipelines_fit_each_gpus_shared_memory():
  """Triton stops on a pipeline that asks for more shared memory than the GPU has (an A100 163 KiB a block, sm_86
  and sm_89 cards 99 KiB; the defaults were an H100's). The estimate reproduces what Triton asked on an H100, the
  tiles fit every listed card from sm_80 on in bf16 and float32, and those that fit (Hopper's) are unchanged."""
  from sparsejax.kernels.gmm import triton as T
  assert T.pipeline_bytes(128, 64, 256, 3, 4, tgmm=False) == 288 * 1024  # triton.py's _for_dtype note
  for dtype in (jnp.bfloat16, jnp.float32):
    size = jnp.dtype(dtype).itemsize
    unfitted = T._for_dtype(T.DEFAULT_TILING, dtype)  # off the GPU: no limit
    for cc, kib in kernels.SHARED_MEMORY_KIB.items():
      if cc < (8, 0):
        continue
      t = T.fit_shared_memory(unfitted, size, kib * 1024)
      assert T.pipeline_bytes(128, t.block_k, t.block_n, t.num_stages, size, tgmm=False) <= kib * 1024, (cc, t)
      assert T.pipeline_bytes(128, t.tgmm_block_k, t.tgmm_block_n, t.tgmm_num_stages, size, tgmm=True) <= kib * 1024
      assert (t == unfitted) == (kib >= 227), (cc, dtype, t)
  a100 = T.fit_shared_memory(T.DEFAULT_TILING, 2, 163 * 1024)
  assert (a100.num_stages, a100.block_n, a100.tgmm_block_n, a100.tgmm_block_k) == (3, 256, 128, 128)
  ada = T.fit_shared_memory(T.DEFAULT_TILING, 2, 99 * 1024)
  assert (ada.num_stages, ada.block_n, ada.block_k, ada.tgmm_block_n, ada.tgmm_block_k) == (2, 256, 64, 64, 128)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_triton_kernels_on_a_99_kib_gpus_tiles_match_reference(monkeypatch, dtype):
  """gmm, the transposed gmm and tgmm on the tiles an sm_86 / sm_89 card gets (fewer stages, narrower tiles: 64
  and 32 wide in float32), interpreted, against the reference across several K and N tiles."""
  from sparsejax.kernels.gmm import triton as T
  monkeypatch.setattr(kernels, "shared_memory_limit", lambda: 99 * 1024)
  assert T._for_dtype(T.DEFAULT_TILING, dtype) != T.DEFAULT_TILING
  groups = GROUPS[0]
  topo, lhs, rhs, rhs_t, dout = _operands(groups, dtype, 300, 330, 7, GROUPS_ROWS)
  out, out_t, dw = _triton_products(lhs, rhs, rhs_t, dout, topo)
  check_rows(out, gmm_reference(lhs, rhs, topo), topo, TOL[dtype])
  check_rows(out_t, gmm_reference(lhs, rhs_t, topo, transpose_rhs=True), topo, TOL[dtype])
  assert rel_err(dw, tgmm_reference(lhs, dout, topo)) < TOL[dtype]


def _check_fused_expert_mlp(groups, activation, glu, seed):
  """expert_mlp on the Mosaic backend (with glu, the gated form) against the float32 reference:
  values and every gradient, bf16 out, zero rows where an active block holds no token, zero
  gradients for an empty expert. d = f = 300 cross K and N tiles."""
  d = f = 300
  topo = topology_for(groups)
  rows = topo.num_row_blocks * topo.block_size
  n_in = 2 if glu else 1  # (w_gate,) w_in
  x, *normal = _normal_draws(jax.random.key(seed), ((rows, d),) + ((3, d, f),) * n_in + ((3, f, d), (rows, d)),
                             (jnp.bfloat16,) + (jnp.float32,) * (n_in + 2))
  w_first = [(w / d**0.5).astype(jnp.bfloat16) for w in normal[:n_in]]
  w_out = (normal[n_in] / f**0.5).astype(jnp.bfloat16)
  ct = normal[-1].astype(jnp.bfloat16)
  args = (x, *w_first, w_out)
  gate = lambda ws: ws[0] if glu else None
  fused = lambda a, *ws: G.expert_mlp(a, ws[-2], ws[-1], topo, activation=activation, backend="mosaic",
                                      w_gate=gate(ws))
  ref = lambda a, *ws: G.mlp_reference(a, ws[-2], ws[-1], topo, activation, w_gate=gate(ws))

  def ref_value_and_grads(*a):
    y, vjp = jax.vjp(ref, *a)
    return y, vjp(ct)

  # The reference as one jitted program, finished before the kernels start: op by op, beside the
  # interpreted kernels, it queued dozens of small computations on the device they run on.
  y_ref, g_ref = jax.block_until_ready(jax.jit(ref_value_and_grads)(*args))
  # One forward serves the values and the gradients (interpreting a kernel is the test's cost); jitted, each pass is
  # one program (op by op, the index arithmetic around the kernels compiled dozens of small ones).
  y, vjp = jax.vjp(jax.jit(fused), *args)
  assert y.dtype == jnp.bfloat16
  check_rows(y, y_ref, topo, TOL[jnp.bfloat16])
  g = vjp(ct)
  assert all(a.dtype == jnp.bfloat16 for a in g)
  check_rows(g[0], g_ref[0], topo, TOL[jnp.bfloat16])
  for a, b in zip(g[1:], g_ref[1:], strict=True):
    assert rel_err(a, b) < TOL[jnp.bfloat16]
  empty = groups.index(0)
  assert all(np.all(np.asarray(w)[empty] == 0) for w in g[1:])


def _by_reference(monkeypatch, *kernels):
  """Sends expert_mlp's calls of mosaic's `kernels` ("gmm": plain and transposed; "tgmm") to their
  references, in a test of the other kernels. Those keep their configs there, on which the fused
  MLP tests (and tgmm's own) interpret them already; interpreting them again was half of such a
  test's time. The kernels under test still feed every value and gradient the test checks."""
  # Each jitted, so that a call is one computation, not a queue of small ones.
  @functools.partial(jax.jit, static_argnums=3)
  def tgmm(lhs, dout, topo, out_dtype):
    # Only the real rows, as the kernel reads them: the rows of inactive blocks are unwritten (NaN
    # in the interpreter), and the reference's einsum would carry them as NaN * 0.
    real = real_rows(topo)[:, None]
    return G.tgmm_reference(jnp.where(real, lhs, 0), jnp.where(real, dout, 0), topo, out_dtype)

  gmm = jax.jit(G.gmm_reference, static_argnums=(3, 4))
  refs = {"gmm": lambda lhs, rhs, topo, transpose_rhs, out_dtype, configs=None: gmm(
              lhs, rhs, topo, transpose_rhs, jnp.dtype(out_dtype)),
          "tgmm": lambda lhs, dout, topo, out_dtype, configs=None: tgmm(lhs, dout, topo, jnp.dtype(out_dtype))}
  for kernel in kernels:
    monkeypatch.setattr(mosaic, kernel, refs[kernel])


@pytest.mark.parametrize("schedule", ["pingpong", "cooperative"])
def test_mosaic_fused_expert_mlp_matches_reference(monkeypatch, schedule):
  """Every Hopper kernel through expert_mlp's custom_vjp: gmm_act (gelu in the epilogue, writing
  pre and act(pre)), gmm (h W_out), gmm_dact (its derivative in the dH = dY W_out^T epilogue, pre
  arriving by TMA), tgmm (both weight gradients) and the transposed gmm (dX). An empty expert, a
  mostly-padding last block and an inactive spare block. gmm_act and gmm_dact on the ping-pong
  schedule (the default) and on the cooperative one."""
  if schedule == "cooperative":
    monkeypatch.setattr(mosaic, "INTERPRET_CONFIGS", dataclasses.replace(
        mosaic.INTERPRET_CONFIGS, **mosaic.INTERPRET_COOPERATIVE))
    _by_reference(monkeypatch, "gmm", "tgmm")  # the pingpong case runs them
  _check_fused_expert_mlp([130, 0, 70], jax.nn.gelu, glu=False, seed=11)


def test_mosaic_fused_glu_expert_mlp_matches_reference(monkeypatch):
  """The GLU form (silu(x W_gate) * x W_in) W_out through its custom_vjp: gmm_glu (two
  accumulators, the product in the epilogue), gmm_dglu (both derivatives in the dY W_out^T
  epilogue, g and u arriving by TMA), three tgmm and two transposed gmm. An empty expert, one
  whose rows fill only the first consumer's half, and an inactive spare block. The weight
  gradients walk their tiles N-fastest here (tgmm_long's order), the gelu test M-fastest."""
  tgmm = dataclasses.replace(mosaic.INTERPRET_CONFIGS.tgmm, grid_minor_dim=mosaic.N_DIM)
  monkeypatch.setattr(mosaic, "INTERPRET_CONFIGS", dataclasses.replace(mosaic.INTERPRET_CONFIGS, tgmm=tgmm))
  _check_fused_expert_mlp([0, 150, 40], jax.nn.silu, glu=True, seed=12)


def _interpret_epilogue_configs():
  """INTERPRET_CONFIGS with gmm_act and gmm_dact on mosaic_epilogue.CONFIGS' tiles, but the
  interpreter's K steps and ring depth."""
  return dataclasses.replace(mosaic.INTERPRET_CONFIGS, **{
      kind: dataclasses.replace(cfg, tile_k=128, max_concurrent_steps=2)
      for kind, cfg in mosaic_epilogue.CONFIGS.items()})


@pytest.mark.parametrize("activation", [jax.nn.gelu, jax.nn.silu])
def test_mosaic_epilogue_warpgroup_matches_reference(monkeypatch, activation):
  """gmm_act and gmm_dact with the epilogue in a fourth warpgroup (mosaic_epilogue.py) through
  expert_mlp's custom_vjp: its tiles and the interpreter's K steps and ring, so the ring and the
  two staging buffers wrap across tiles; an empty expert, a block with rows in its first 64-row
  half only, and an inactive spare block."""
  monkeypatch.setattr(mosaic, "INTERPRET_CONFIGS", _interpret_epilogue_configs())
  _by_reference(monkeypatch, "gmm", "tgmm")
  _check_fused_expert_mlp([130, 0, 70], activation, glu=False, seed=14)


@pytest.mark.parametrize("schedule,saved", [("pingpong", "pre"), ("cooperative", "pre"), ("epilogue_wg", "pre"),
                                            ("pingpong", "derivative"), ("cooperative", "derivative")])
def test_mosaic_gmm_act_outputs_follow_the_contract(schedule, saved):
  """gmm_act alone (ping-pong, cooperative, with the epilogue warpgroup), lhs random on every row:
  pre (or, with SaveDerivative, act'(pre)) and act(pre) match the reference on the real rows and are
  exactly zero on the rows of active blocks that hold no token (expert_mlp never reads those, so only
  a direct call sees them; act'(0) is not zero, so the derivative form must select)."""
  from sparsejax.activations import DERIVATIVES
  topo, lhs, rhs, _, _ = _operands([130, 0, 70], jnp.bfloat16, 300, 300, 5)
  cfgs = {"pingpong": None, "epilogue_wg": _interpret_epilogue_configs(),
          "cooperative": dataclasses.replace(mosaic.INTERPRET_CONFIGS, **mosaic.INTERPRET_COOPERATIVE)}[schedule]
  act = mosaic.SaveDerivative(jax.nn.gelu) if saved == "derivative" else jax.nn.gelu
  first, h = jax.jit(lambda l, r, t: mosaic.gmm_act(l, r, t, act, cfgs))(lhs, rhs, topo)
  want = gmm_reference(lhs, rhs, topo)
  if saved == "derivative":
    want_first = jnp.where(real_rows(topo)[:, None], DERIVATIVES[jax.nn.gelu](want.astype(jnp.float32)), 0.0)
  else:
    want_first = want
  check_rows(first, want_first, topo, TOL[jnp.bfloat16])
  check_rows(h, jax.nn.gelu(want.astype(jnp.float32)), topo, TOL[jnp.bfloat16])


def test_mosaic_epilogue_warpgroup_refuses_the_saved_derivative():
  """mosaic_epilogue's kernels apply act or act' to pre themselves: handed act'(pre) forms they
  would compute something else, so _gmm_call refuses them with one line."""
  topo, lhs, rhs, rhs_t, pre = _operands([130, 0, 70], jnp.bfloat16, 128, 128, 1)
  cfgs = _interpret_epilogue_configs()
  with pytest.raises(ValueError, match="takes pre itself"):
    mosaic.gmm_act(lhs, rhs, topo, mosaic.SaveDerivative(jax.nn.gelu), cfgs)
  with pytest.raises(ValueError, match="takes pre itself"):
    mosaic.gmm_dact(lhs, rhs_t, topo, pre, None, cfgs)


@pytest.mark.parametrize("rows_per_expert,activation,want", [
    (384, jax.nn.gelu, True), (384, jax.nn.silu, True), (384, jax.nn.relu, True),
    (384, sj.activations.gelu_exact, False),  # no one-sigmoid form (and not fused at all)
    (2176, jax.nn.gelu, False),  # gmm_act_long is the epilogue warpgroup's kernel
])
def test_expert_mlp_saves_the_derivative_where_both_kernels_take_it(rows_per_expert, activation, want):
  topo = topology_for([rows_per_expert - 128, rows_per_expert - 128])
  rows = topo.num_row_blocks * 128
  assert mosaic.saves_derivative(activation, rows, 2, mosaic.DEFAULT_CONFIGS) is want
  with_dact_wg = dataclasses.replace(mosaic.DEFAULT_CONFIGS, gmm_dact=mosaic_epilogue.CONFIGS["gmm_dact"])
  assert not mosaic.saves_derivative(activation, rows, 2, with_dact_wg)


def test_mosaic_epilogue_warpgroup_dact_zeroes_padding_rows_whatever_pre_holds():
  """gmm_dact alone, with pre NaN on the rows that hold no token (expert_mlp's pre is zero there;
  any caller's may be anything): those rows of active blocks are still exactly zero."""
  from sparsejax.activations import DERIVATIVES
  topo, lhs, _, rhs_t, pre = _operands([130, 0, 70], jnp.bfloat16, 300, 300, 2)
  real = real_rows(topo)[:, None]
  pre = jnp.where(real, pre, jnp.nan)
  cfgs = _interpret_epilogue_configs()
  out = jax.jit(lambda l, r, t, p: mosaic.gmm_dact(l, r, t, p, jax.nn.gelu, cfgs))(lhs, rhs_t, topo, pre)
  want = (gmm_reference(lhs, rhs_t, topo, transpose_rhs=True).astype(jnp.float32)
          * DERIVATIVES[jax.nn.gelu](pre.astype(jnp.float32)))
  check_rows(out, jnp.where(real, want, 0.0), topo, TOL[jnp.bfloat16])


def test_mosaic_epilogue_warpgroup_serves_the_activation_kernels_only():
  topo, lhs, rhs, _, _ = _operands([130, 0, 70], jnp.bfloat16, 128, 128, 1)
  bad = dataclasses.replace(mosaic.INTERPRET_CONFIGS, gmm=mosaic.Config(epilogue_wg=True))
  with pytest.raises(ValueError, match="epilogue_wg serves gmm_act and gmm_dact; got it for gmm"):
    mosaic.gmm(lhs, rhs, topo, False, jnp.bfloat16, bad)


@pytest.mark.parametrize("w_gate", [jnp.ones((2, 8, 17), jnp.bfloat16), jnp.ones((2, 8, 16), jnp.float32)])
def test_expert_mlp_rejects_a_gate_unlike_w_in(w_gate):
  topo = topology_for([5, 3])
  x = jnp.ones((topo.num_row_blocks * 128, 8), jnp.bfloat16)
  w_in, w_out = jnp.ones((2, 8, 16), jnp.bfloat16), jnp.ones((2, 16, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match="w_gate must match w_in"):
    jax.eval_shape(lambda g: G.expert_mlp(x, w_in, w_out, topo, w_gate=g), w_gate)


@pytest.mark.parametrize("rows_per_expert,want", [(384, "tgmm_short"), (1152, "tgmm"), (4224, "tgmm_long")])
def test_mosaic_tgmm_picks_its_config_by_rows_per_expert(monkeypatch, rows_per_expert, want):
  """Experts averaging fewer than SHORT_ROWS rows take tgmm_short (the ping-pong kernel), LONG_ROWS
  or more tgmm_long (tiles N-fastest), the rest tgmm (the per-tile kernel)."""
  from sparsejax.kernels.gmm import mosaic_pingpong
  seen = []
  fake = lambda kernel: lambda lhs, dout, *a, cfg, **k: seen.append((kernel, cfg)) or jnp.zeros(
      (2, lhs.shape[1], dout.shape[1]), lhs.dtype)
  monkeypatch.setattr(mosaic, "_tgmm_padded", fake("per_tile"))
  monkeypatch.setattr(mosaic_pingpong, "tgmm_padded", fake("pingpong"))
  topo = topology_for([rows_per_expert - 128, rows_per_expert - 128])
  lhs = jnp.zeros((topo.num_row_blocks * 128, 128), jnp.bfloat16)
  configs = mosaic.DEFAULT_CONFIGS
  assert configs.tgmm_for(lhs.shape[0], 2) == getattr(configs, want)
  jax.eval_shape(lambda l, t: mosaic.tgmm(l, l, t, jnp.bfloat16, configs), lhs, topo)  # traced: the choice is made
  kernel, cfg = seen[0]
  assert kernel == ("pingpong" if want == "tgmm_short" else "per_tile")
  assert cfg.grid_minor_dim == (mosaic.N_DIM if want == "tgmm_long" else mosaic.M_DIM)


def test_mosaic_tgmm_of_a_single_output_tile():
  """K = 128 and N = 256 make tgmm's grid one tile per expert (its tile order is then constant,
  which once crashed XLA:CPU's constant folding in interpret mode)."""
  topo, lhs, _, _, dout = _operands([130, 0, 40], jnp.bfloat16, 128, 256, 4)
  dw = G.tgmm(lhs, dout, topo, backend="mosaic")
  assert dw.shape == (3, 128, 256) and dw.dtype == jnp.bfloat16
  assert rel_err(dw, tgmm_reference(lhs, dout, topo)) < TOL[jnp.bfloat16]
  assert np.all(np.asarray(dw)[1] == 0)


GMM_KINDS = ("gmm", "gmm_t", "gmm_act", "gmm_dact", "gmm_glu", "gmm_glu_short", "gmm_dglu")


def _with_expert_bands(configs, width=None):
  """configs with every gmm kind walking expert_band_order (at `width` row blocks a band if given)."""
  return dataclasses.replace(configs, **{
      k: dataclasses.replace(getattr(configs, k), expert_bands=True,
                             grid_tile_width=width or getattr(configs, k).grid_tile_width)
      for k in GMM_KINDS})


@pytest.mark.parametrize("glu", [False, True])
def test_mosaic_expert_mlp_in_expert_band_order(monkeypatch, glu):
  """Every gmm kind (plain, transposed, act, dact, glu, dglu) walking its tiles in expert_band_order,
  with bands of 2 row blocks so that the expert of 3 blocks makes two bands (the second reversed),
  through the expert MLP's custom_vjp against the float32 reference."""
  monkeypatch.setattr(mosaic, "INTERPRET_CONFIGS", _with_expert_bands(mosaic.INTERPRET_CONFIGS, width=2))
  _by_reference(monkeypatch, "tgmm")  # no gmm kind: tgmm walks its own order
  _check_fused_expert_mlp([300, 0, 70], jax.nn.silu if glu else jax.nn.gelu, glu=glu, seed=15 + glu)


@pytest.mark.parametrize("groups,bound,n_iters,width", [([300, 0, 70, 129], None, 3, 2), ([257], 5 * 128, 2, 8),
                                                        ([0, 0, 0], 2 * 128, 4, 4), ([1] * 9, None, 1, 3)])
def test_expert_band_order_is_a_permutation_of_expert_aligned_bands(groups, bound, n_iters, width):
  """The order is a permutation of the tiles; cut into runs of one band's tiles, every run holds the
  row blocks of one expert (or of the inactive tail) at most `width` of them, each of them once per
  column tile, column tiles ascending in a run of even index within its expert, descending in an odd one."""
  topo = topology_for(groups, bound)
  nb = topo.num_row_blocks
  order = np.asarray(jax.jit(mosaic.expert_band_order, static_argnums=(2, 3))(
      topo.row_block_expert, topo.expert_block_offsets, n_iters, width))
  np.testing.assert_array_equal(np.sort(order), np.arange(nb * n_iters))
  m, n = order // n_iters, order % n_iters
  offsets = np.asarray(topo.expert_block_offsets)
  active = offsets[-1]
  group = np.where(m < active, np.asarray(topo.row_block_expert)[m], len(groups))  # the tail: one group
  p = 0
  while p < len(order):
    g, first = group[p], (offsets[group[p]] if group[p] < len(groups) else active)
    band = (m[p] - first) // width
    run = len(set(range(first + band * width, min(first + (band + 1) * width,
                                                  offsets[g + 1] if g < len(groups) else nb)))) * n_iters
    ms, ns = m[p:p + run], n[p:p + run]
    assert np.all(group[p:p + run] == g) and len(set(ms)) <= width
    cols = ns.reshape(n_iters, -1)  # m fastest within the band
    assert np.all(cols == cols[:, :1]) and sorted(set(ms)) == sorted(ms[:run // n_iters])
    steps = np.diff(cols[:, 0])
    assert np.all(steps == (-1 if band % 2 else 1)) if n_iters > 1 else True
    p += run


def test_expert_bands_needs_row_blocks_minor():
  topo, lhs, rhs, _, _ = _operands([130, 0, 70], jnp.bfloat16, 128, 128, 1)
  bad = dataclasses.replace(mosaic.INTERPRET_CONFIGS, gmm=mosaic.Config(expert_bands=True, grid_minor_dim=mosaic.N_DIM))
  with pytest.raises(ValueError, match="expert_bands orders row blocks within column tiles"):
    mosaic.gmm(lhs, rhs, topo, False, jnp.bfloat16, bad)


@pytest.mark.parametrize("active_tiles,num_sms,want", [
    (672, 132, (4, 660)),   # skewed E64 top-1's gmm: 12 tiles past 5 waves -> 48 quarter pieces
    (640, 132, (1, 640)),   # 112 past 4 waves: halves would be 224 pieces, two on some SMs
    (700, 132, (2, 660)),   # 40 past: 80 halves, 160 quarters would not fit one wave
    (660, 132, (4, 660)),   # whole waves: no tail
    (3, 2, (2, 2)), (5, 11, (2, 0)), (2, 11, (4, 0)), (8, 3, (1, 8))])
def test_tail_split_cuts_the_last_wave_into_one_piece_an_sm(active_tiles, num_sms, want):
  split, main_end, tail = jax.jit(mosaic.tail_split, static_argnums=(1, 2))(jnp.int32(active_tiles), num_sms, (2, 4))
  assert (int(split), int(main_end)) == want
  assert int(tail) == active_tiles % num_sms
  assert int(split) == 1 or int(split) * int(tail) <= num_sms


# Halves (5 SMs: 2 tiles past two waves), quarters (11: 1 past one) and a tail too long to split (7: 5).
@pytest.mark.parametrize("num_sms,transpose_rhs", [(5, False), (11, True), (7, False)])
def test_mosaic_gmm_with_its_last_wave_split(monkeypatch, num_sms, transpose_rhs):
  """The cooperative gmm with Config.split_tail: 12 active tiles (6 row blocks x 2 column tiles of 256)
  on num_sms interpreted SMs, so the tail runs as half- or quarter-width pieces, or whole; each
  case against the float32 reference, padding rows zero, inactive rows unwritten."""
  monkeypatch.setattr(mosaic, "_num_sms", lambda: num_sms)
  topo, lhs, rhs, rhs_t, _ = _operands([300, 0, 70, 129], jnp.bfloat16, 256, 512, 40 + num_sms)
  cfg = mosaic.Config(tile_n=256, tile_k=128, max_concurrent_steps=2, expert_bands=True, grid_tile_width=2,
                      split_tail=True)
  configs = dataclasses.replace(mosaic.INTERPRET_CONFIGS, gmm=cfg, gmm_t=cfg)
  w = rhs_t if transpose_rhs else rhs
  out = jax.jit(lambda l, w, t: mosaic.gmm(l, w, t, transpose_rhs, jnp.bfloat16, configs))(lhs, w, topo)
  check_rows(out, gmm_reference(lhs, w, topo, transpose_rhs=transpose_rhs), topo, TOL[jnp.bfloat16])


def test_split_tail_needs_the_cooperative_kernel_in_expert_bands():
  topo, lhs, rhs, _, _ = _operands([130, 0, 70], jnp.bfloat16, 128, 128, 1)
  for cfg in (mosaic.Config(split_tail=True), mosaic.Config(split_tail=True, expert_bands=True, pingpong=True)):
    bad = dataclasses.replace(mosaic.INTERPRET_CONFIGS, gmm=cfg)
    with pytest.raises(ValueError, match="split_tail serves the cooperative kernel"):
      mosaic.gmm(lhs, rhs, topo, False, jnp.bfloat16, bad)


def test_heaviest_first_orders_experts_by_row_blocks():
  """The tgmm tile order's expert permutation: most row blocks first, ties by index (a stable sort)."""
  rng = np.random.default_rng(0)
  for e in (1, 5, 64):
    blocks = rng.integers(0, 4, e)  # many ties
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(blocks)]), jnp.int32)
    order = np.asarray(jax.jit(mosaic.heaviest_first)(offsets))
    np.testing.assert_array_equal(order, np.argsort(-blocks, kind="stable"))


@pytest.mark.parametrize("tile_k", [32, 64, 128])
def test_tgmm_plan_counts_each_experts_real_rows_in_steps(tile_k):
  """tgmm_plan's row p for expert order[p]: ceil(real rows / tile_k) steps (none for an empty expert), the real
  rows of the last step, and the first step's index, counted here from the tokens an expert holds."""
  tokens = [130, 0, 70, 256, 1, 384, 127]  # partial blocks, an empty expert, whole blocks, one row
  topo = topology_for(tokens)
  order = jnp.asarray([3, 1, 6, 0, 5, 2, 4], jnp.int32)
  plan = np.asarray(jax.jit(functools.partial(mosaic.tgmm_plan, block_m=128, tile_k=tile_k))(
      order, topo.expert_block_offsets, topo.row_block_rows))
  first_block = np.concatenate([[0], np.cumsum([-(-t // 128) for t in tokens])])[:-1]
  for p, e in enumerate(np.asarray(order)):
    steps = -(-tokens[e] // tile_k)
    tail = tokens[e] - (steps - 1) * tile_k
    assert plan[p].tolist() == [e, steps, tail, first_block[e] * (128 // tile_k)], (p, e)


@pytest.mark.parametrize("total,width", [(1, 2), (4, 2), (5, 2), (2048, 132), (2100, 132), (7, 8)])
def test_tgmm_item_is_a_permutation_with_every_second_full_wave_reversed(total, width):
  steps = np.arange(total)
  items = np.asarray(mosaic._tgmm_item(jnp.asarray(steps, jnp.int32), total, width))
  np.testing.assert_array_equal(np.sort(items), steps)
  for wave in range(total // width):  # full waves: forwards, then backwards
    got = items[wave * width:(wave + 1) * width]
    want = steps[wave * width:(wave + 1) * width]
    np.testing.assert_array_equal(got, want[::-1] if wave % 2 else want)


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("balance", [True, False])
def test_mosaic_tgmm_in_either_expert_order(monkeypatch, balance, streamed):
  """Heaviest-first with reversed waves (the default) and plain expert order give the same
  gradient, with a pipeline per tile and with one ring for all of a CTA's tiles; the skewed
  sizes make the two orders differ, and two interpreted "SMs" over four one-tile experts make a
  second, reversed wave."""
  cfg = dataclasses.replace(mosaic.INTERPRET_CONFIGS.tgmm, balance_experts=balance, streamed=streamed)
  monkeypatch.setattr(mosaic, "INTERPRET_CONFIGS", dataclasses.replace(mosaic.INTERPRET_CONFIGS, tgmm=cfg))
  topo, lhs, _, _, dout = _operands([40, 0, 300, 130], jnp.bfloat16, 128, 256, 5)
  dw = jax.jit(lambda l, d, t: G.tgmm(l, d, t, backend="mosaic"))(lhs, dout, topo)
  assert rel_err(dw, tgmm_reference(lhs, dout, topo)) < TOL[jnp.bfloat16]
  assert np.all(np.asarray(dw)[1] == 0)


def _pingpong_configs(**overrides):
  """INTERPRET_CONFIGS with tgmm (and tgmm_long) on the ping-pong schedule: 128 x 128 tiles, one
  ring 2 slots deep for both consumers, so it wraps within a tile and across tiles and consumers."""
  return mosaic.INTERPRET_CONFIGS.with_tgmm(pingpong=True, **overrides)


@pytest.mark.parametrize("groups,k,n,out_dtype,balance", [
    # Skewed, an empty expert, tails of 40, 44 and 2 rows in the last 64-row step; 2 x 3 tiles an
    # expert: each interpreted SM walks 12 tiles, 6 per consumer. Heaviest-first, reversed waves.
    ([40, 0, 300, 130], 256, 384, jnp.bfloat16, True),
    ([40, 0, 300, 130], 256, 384, jnp.float32, False),  # experts in index order
    ([0, 0, 300, 0], 256, 512, jnp.float32, True),  # all rows on one expert
    ([257], 300, 330, jnp.bfloat16, True),  # one expert; K and N padded to the tiles, a 1-row tail
])
def test_mosaic_pingpong_tgmm_matches_reference(groups, k, n, out_dtype, balance):
  """tgmm on the ping-pong schedule (mosaic_pingpong.py, each consumer owning every second tile of
  its CTA, one ring for both) against the float32 reference; lhs and dout random on the padding rows
  too, so an unmasked tail shows; an expert with no rows gets an exact zero gradient."""
  topo, lhs, _, _, dout = _operands(groups, jnp.bfloat16, k, n, 17 + len(groups))
  cfgs = _pingpong_configs(balance_experts=balance)
  dw = jax.jit(lambda l, d, t: mosaic.tgmm(l, d, t, out_dtype, cfgs))(lhs, dout, topo)
  assert dw.dtype == out_dtype and dw.shape == (len(groups), k, n)
  assert rel_err(dw, tgmm_reference(lhs, dout, topo, jnp.float32)) < TOL[out_dtype]
  empty = [i for i, g in enumerate(groups) if g == 0]
  assert np.all(np.asarray(dw)[empty] == 0)


@pytest.mark.parametrize("schedule", ["triton", "per_tile", "streamed", "pingpong"])
def test_tgmm_ignores_whatever_dout_holds_past_the_real_rows(schedule):
  """tgmm sums real rows only: dout NaN on every other row (a caller's unwritten padding, or inf)
  leaves the gradient equal to the reference's, on both backends and every Mosaic schedule. The
  padding rows are selected away, not multiplied by a 0/1 mask (NaN * 0 is NaN)."""
  topo, lhs, _, _, dout = _operands([40, 0, 300, 130], jnp.bfloat16, 128, 256, 21)
  real = real_rows(topo)[:, None]
  nan_dout = jnp.where(real, dout, jnp.nan)
  if schedule == "triton":
    tgmm = lambda l, d, t: G.tgmm(l, d, t, backend="triton", out_dtype=jnp.float32)
  else:
    changes = dict(per_tile={}, streamed=dict(streamed=True), pingpong=dict(pingpong=True))[schedule]
    cfgs = mosaic.INTERPRET_CONFIGS.with_tgmm(**changes)
    tgmm = lambda l, d, t: mosaic.tgmm(l, d, t, jnp.float32, cfgs)
  dw = jax.jit(tgmm)(lhs, nan_dout, topo)
  assert rel_err(dw, tgmm_reference(lhs, jnp.where(real, dout, 0), topo, jnp.float32)) < TOL[jnp.bfloat16]


def test_mosaic_pingpong_rejects_a_second_schedule():
  topo, lhs, rhs, _, _ = _operands([130, 0, 70], jnp.bfloat16, 128, 128, 1)
  bad = dataclasses.replace(mosaic.INTERPRET_CONFIGS, gmm_act=mosaic.Config(pingpong=True, epilogue_wg=True))
  with pytest.raises(ValueError, match="two schedules; gmm_act got both"):
    mosaic.gmm_act(lhs, rhs, topo, jax.nn.gelu, bad)


def _pingpong_gmm_configs(slots=2):
  """INTERPRET_CONFIGS with every one-weight gmm kind on the ping-pong schedule: 128 x 128 tiles,
  64-deep K steps and a `slots`-deep ring, so the ring wraps within a tile and across tiles and
  consumers."""
  pp = mosaic.Config(pingpong=True, tile_n=128, tile_k=64, max_concurrent_steps=slots, epi_tile_n=32)
  return dataclasses.replace(mosaic.INTERPRET_CONFIGS, gmm=pp, gmm_t=pp, gmm_act=pp, gmm_dact=pp)


@pytest.mark.parametrize("groups,slots,bands,rows_bound", [
    # An empty expert, an expert whose rows fit the first 64-row half (its wgmmas run on those
    # only), tails, an inactive spare block; 3 N tiles (300 padded to 384) and 4 K steps a tile,
    # through a ring of 3 (which divides no tile), in expert_band_order. (planar_snake order and a
    # ring of 2: the fused MLP tests, on INTERPRET_CONFIGS.)
    ([130, 0, 40, 70], 3, True, None),
    ([5], 2, False, 128),  # one block, one 64-wide N tile (n = 40): the second interpreted SM has none
])
def test_mosaic_pingpong_gmm_kinds_match_reference(groups, slots, bands, rows_bound):
  """gmm, the transposed gmm, gmm_act and gmm_dact on the ping-pong schedule (mosaic_pingpong.py:
  one ring for both consumers, each waiting on its own steps' barriers, the K loops taking turns)
  against the reference: lhs random on every row, gmm_dact's pre NaN on the rows without a token,
  and those rows of active blocks exactly zero in every output."""
  from sparsejax.activations import DERIVATIVES
  n = 40 if rows_bound else 300
  topo = topology_for(groups, num_rows_bound=rows_bound)
  rows = topo.num_row_blocks * 128
  lhs, rhs, rhs_t, pre = _normal_draws(jax.random.key(len(groups) + slots),
                                       ((rows, 256), (len(groups), 256, n), (len(groups), n, 256), (rows, n)),
                                       jnp.bfloat16)
  real = real_rows(topo)[:, None]
  pre = jnp.where(real, pre, jnp.nan)
  cfgs = _pingpong_gmm_configs(slots)
  if bands:
    cfgs = _with_expert_bands(cfgs, width=2)
  want = gmm_reference(lhs, rhs, topo)
  gmm = jax.jit(lambda l, r, t, transpose: mosaic.gmm(l, r, t, transpose, jnp.bfloat16, cfgs), static_argnums=3)
  act = jax.jit(lambda l, r, t, f: mosaic.gmm_act(l, r, t, f, cfgs), static_argnums=3)
  dact = jax.jit(lambda l, r, t, p, f: mosaic.gmm_dact(l, r, t, p, f, cfgs), static_argnums=4)
  check_rows(gmm(lhs, rhs, topo, False), want, topo, TOL[jnp.bfloat16])
  check_rows(gmm(lhs, rhs_t, topo, True),
             gmm_reference(lhs, rhs_t, topo, transpose_rhs=True), topo, TOL[jnp.bfloat16])
  p, h = act(lhs, rhs, topo, jax.nn.gelu)
  check_rows(p, want, topo, TOL[jnp.bfloat16])
  check_rows(h, jax.nn.gelu(want.astype(jnp.float32)), topo, TOL[jnp.bfloat16])
  d = dact(lhs, rhs_t, topo, pre, jax.nn.gelu)
  dh = gmm_reference(lhs, rhs_t, topo, transpose_rhs=True).astype(jnp.float32)
  want_d = dh * DERIVATIVES[jax.nn.gelu](pre.astype(jnp.float32))
  check_rows(d, jnp.where(real, want_d, 0.0), topo, TOL[jnp.bfloat16])
  # The saved-derivative forms: gmm_act's first output act'(pre), gmm_dact's product times pre as given.
  sd, h2 = act(lhs, rhs, topo, mosaic.SaveDerivative(jax.nn.gelu))
  check_rows(sd, jnp.where(real, DERIVATIVES[jax.nn.gelu](want.astype(jnp.float32)), 0.0), topo, TOL[jnp.bfloat16])
  np.testing.assert_array_equal(np.asarray(h2)[np.asarray(real[:, 0])], np.asarray(h)[np.asarray(real[:, 0])])
  d2 = dact(lhs, rhs_t, topo, pre, None)
  check_rows(d2, jnp.where(real, dh * pre.astype(jnp.float32), 0.0), topo, TOL[jnp.bfloat16])


def test_mosaic_pingpong_glu_expert_mlp_matches_reference(monkeypatch):
  """The GLU forms on the ping-pong schedule (gmm_glu_short's; opt-in for gmm_dglu): gmm_glu (two [128, 64] accumulators a
  consumer, act(g) * u in the epilogue) and gmm_dglu (g and u tiles by TMA) through the GLU
  expert MLP's custom_vjp. An empty expert, one with rows in its first 64-row half only, and an
  inactive spare block; d = f = 300 over several 64-wide N tiles."""
  pp = mosaic.Config(pingpong=True, tile_n=128, tile_k=128, max_concurrent_steps=2, epi_tile_n=32)
  monkeypatch.setattr(mosaic, "INTERPRET_CONFIGS",
                      dataclasses.replace(mosaic.INTERPRET_CONFIGS, gmm_glu=pp, gmm_glu_short=pp, gmm_dglu=pp))
  _by_reference(monkeypatch, "gmm", "tgmm")  # the GLU test on the cooperative schedule runs them
  _check_fused_expert_mlp([0, 150, 40], jax.nn.silu, glu=True, seed=13)


def test_mosaic_pingpong_gmm_fit_shrinks_to_shared_memory():
  """One ring of 32 KiB stages: gmm_act's 6 slots and two consumers' store slots of 32 columns fit;
  gmm_dact's pre tiles (32 KiB a consumer) leave room for 4; 256-wide tiles come down to 128, 64
  for the GLU forms; gmm_dglu's two pre tiles take 64-wide tiles rather than a 2-deep ring."""
  from sparsejax.kernels.gmm import mosaic_pingpong
  cfg = mosaic.Config(pingpong=True, tile_n=256, tile_k=64, max_concurrent_steps=6, epi_tile_n=32)
  act = mosaic_pingpong.fit_gmm(cfg, 1024, 4096, 128, 0, jnp.bfloat16, jnp.bfloat16)
  assert (act.tile_n, act.max_concurrent_steps, act.epi_tile_n) == (128, 6, 32)
  dact = mosaic_pingpong.fit_gmm(cfg, 1024, 4096, 128, 1, jnp.bfloat16, jnp.bfloat16)
  assert (dact.tile_n, dact.max_concurrent_steps, dact.epi_tile_n) == (128, 4, 32)
  glu = mosaic_pingpong.fit_gmm(cfg, 1024, 4096, 128, 0, jnp.bfloat16, jnp.bfloat16, num_w=2)
  assert (glu.tile_n, glu.max_concurrent_steps) == (64, 6)  # two accumulators: half-wide tiles
  dglu = mosaic_pingpong.fit_gmm(cfg, 1024, 4096, 128, 2, jnp.bfloat16, jnp.bfloat16)
  assert (dglu.tile_n, dglu.max_concurrent_steps, dglu.epi_tile_n) == (64, 6, 16)  # narrower, not 2 slots
  with pytest.raises(ValueError, match="no tiles of"):
    mosaic_pingpong.fit_gmm(cfg, 1024, 4096, 256, 1, jnp.float32, jnp.float32)


def test_mosaic_pingpong_fit_shrinks_to_shared_memory():
  """One ring of 32 KiB stages: 8 slots shrink to 6 beside bf16 stores of 32 columns (float32
  stores to 16-column pieces first); 256-wide tiles come down to 128 (the accumulator's
  registers); float32 operands (64 KiB stages) fit 3 slots beside 16-column pieces, and nothing
  fits them at 256-row blocks."""
  from sparsejax.kernels.gmm import mosaic_pingpong
  cfg = mosaic.Config(tile_n=256, tile_k=64, max_concurrent_steps=8, epi_tile_n=32)
  bf16 = mosaic_pingpong.fit(cfg, 4096, 128, jnp.bfloat16, jnp.bfloat16)
  assert (bf16.tile_n, bf16.max_concurrent_steps, bf16.epi_tile_n) == (128, 6, 32)
  f32 = mosaic_pingpong.fit(cfg, 4096, 128, jnp.bfloat16, jnp.float32)
  assert (f32.tile_n, f32.max_concurrent_steps, f32.epi_tile_n) == (128, 6, 16)
  f32_in = mosaic_pingpong.fit(cfg, 4096, 128, jnp.float32, jnp.float32)
  assert (f32_in.max_concurrent_steps, f32_in.epi_tile_n) == (3, 16)
  with pytest.raises(ValueError, match="no tiles of"):
    mosaic_pingpong.fit(cfg, 4096, 256, jnp.float32, jnp.float32)


@pytest.mark.parametrize("epi_slots,minor,out_dtype", [(4, mosaic.M_DIM, jnp.bfloat16),
                                                       (2, mosaic.N_DIM, jnp.float32)])
def test_mosaic_streamed_tgmm_across_tiles(monkeypatch, epi_slots, minor, out_dtype):
  """The streamed tgmm over several output tiles per expert (K = 256, N = 520: two row tiles, two
  column tiles of 256 and padding), so the ring wraps across tiles and experts. epi_slots 4 stages
  a consumer's whole tile for its stores; 2 makes the stores wait on each other within a tile.
  Both tile orders; bf16 and float32 gradients; an empty expert gets exact zeros."""
  cfg = dataclasses.replace(mosaic.INTERPRET_CONFIGS.tgmm, streamed=True, epi_slots=epi_slots,
                            grid_minor_dim=minor)
  monkeypatch.setattr(mosaic, "INTERPRET_CONFIGS", dataclasses.replace(mosaic.INTERPRET_CONFIGS, tgmm=cfg))
  topo, lhs, _, _, dout = _operands([0, 257, 70], jnp.bfloat16, 256, 520, 6)
  dw = jax.jit(lambda l, d, t: G.tgmm(l, d, t, out_dtype=out_dtype, backend="mosaic"))(lhs, dout, topo)
  assert dw.shape == (3, 256, 520) and dw.dtype == out_dtype
  assert rel_err(dw, tgmm_reference(lhs, dout, topo)) < TOL[jnp.bfloat16]
  assert np.all(np.asarray(dw)[0] == 0)


def test_mosaic_float32_is_exact():
  """wgmma would read float32 as TF32: float32 operands take the exact Triton kernels instead."""
  topo, lhs, rhs, _, _ = _operands([130, 0, 5, 200], jnp.float32, 32, 48, 3)
  out = G.gmm(lhs, rhs, topo, backend="mosaic")
  assert out.dtype == jnp.float32
  assert rel_err(out, gmm_reference(lhs, rhs, topo)) < TOL[jnp.float32]


@pytest.mark.parametrize("groups", GROUPS[:2])
def test_triton_gradients_match_reference(groups):
  topo, lhs, rhs, _, _ = _operands(groups, jnp.float32, 32, 16, len(groups) + sum(groups))
  ct = jax.random.normal(jax.random.key(5), (lhs.shape[0], 16))
  loss = lambda f: lambda a, b: jnp.sum(jnp.tanh(f(a, b, topo)) * ct)
  g = jax.jit(jax.grad(loss(lambda a, b, t: G.gmm(a, b, t, backend="triton")), argnums=(0, 1)))(lhs, rhs)
  g_ref = jax.jit(jax.grad(loss(G.gmm_reference), argnums=(0, 1)))(lhs, rhs)
  for a, b in zip(g, g_ref):
    assert rel_err(a, b) < 2e-5


@pytest.mark.parametrize("group_sizes,m", [([100, 0, 50, 120], 300), ([0, 37, 0, 0], 37),
                                           ([5], 9), ([3, 4, 2], 9)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_matmul_pallas_has_ragged_dot_semantics(group_sizes, m, dtype):
  keys = jax.random.split(jax.random.key(m + len(group_sizes)), 3)
  gs = jnp.asarray(group_sizes, jnp.int32)
  lhs = jax.random.normal(keys[0], (m, 24), dtype)  # K=24: exercises padding to the tile
  rhs = jax.random.normal(keys[1], (len(group_sizes), 24, 40), dtype)
  ct = jax.random.normal(keys[2], (m, 40))

  def run(impl):  # the product and its gradients, one jitted program each (not op by op)
    def loss(a, b):
      out = sj.grouped_matmul(a, b, gs, impl=impl)
      return jnp.sum(out.astype(jnp.float32) * ct), out
    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))

  g, out = run("triton")(lhs, rhs)
  g_ref, ref = run("reference")(lhs.astype(jnp.float32), rhs.astype(jnp.float32))
  assert out.dtype == dtype
  assert rel_err(out, ref) < TOL[dtype]
  tail = int(gs.sum())
  assert np.all(np.asarray(out[tail:]) == 0)  # rows past the groups are zero
  for a, b in zip(g, g_ref):
    assert rel_err(a, b) < TOL[dtype]


def test_topology_is_block_csr_of_the_padded_layout():
  topo = topology_for([130, 0, 5, 200], num_rows_bound=6 * 128)
  np.testing.assert_array_equal(topo.row_block_expert, [0, 0, 2, 3, 3, 3])
  np.testing.assert_array_equal(topo.expert_block_offsets, [0, 2, 2, 3, 5])
  np.testing.assert_array_equal(topo.row_block_rows, [128, 2, 5, 128, 72, 0])
  assert int(topo.num_active_blocks[0]) == 5
  full = topology_for([130, 0, 5, 200], num_rows_bound=6 * 128, real=False)
  np.testing.assert_array_equal(full.row_block_rows, [128, 128, 128, 128, 128, 0])
  with pytest.raises(ValueError, match="multiple of block_size"):
    make_topology(jnp.array([128]), 130, 128)


def test_auto_backend_is_mosaic_only_on_hopper(monkeypatch):
  from sparsejax.kernels.gmm import op
  monkeypatch.setattr(op, "_gpu_compute_capability", lambda: "9.0")
  assert op.resolve_backend("auto") == "mosaic"
  monkeypatch.setattr(op, "_gpu_compute_capability", lambda: "8.0")
  assert op.resolve_backend("auto") == "triton"
  monkeypatch.setattr(op, "_gpu_compute_capability", lambda: None)
  assert op.resolve_backend("auto") == "triton"
  with pytest.raises(ValueError, match="backend must be one of"):
    op.resolve_backend("cuda")


def test_gmm_rejects_mismatched_topology():
  topo = topology_for([10, 20])
  with pytest.raises(ValueError, match="rows"):
    G.gmm(jnp.zeros((100, 16)), jnp.zeros((2, 16, 16)), topo)
  with pytest.raises(ValueError, match="experts"):
    G.gmm(jnp.zeros((topo.num_row_blocks * 128, 16)), jnp.zeros((3, 16, 16)), topo)


def _spy_on_gmm_schedules(monkeypatch, rows_per_expert, num_out):
  """The three gmm schedules' kernels replaced by fakes that record (schedule, config) and return
  num_out zero outputs; two experts of rows_per_expert padded rows: (seen, topo, lhs, w)."""
  from sparsejax.kernels.gmm import mosaic_pingpong
  seen = []
  fake = lambda kernel: lambda lhs, weights, *a, cfg, **k: seen.append((kernel, cfg)) or (
      jnp.zeros((lhs.shape[0], weights[0].shape[2]), lhs.dtype),) * num_out
  monkeypatch.setattr(mosaic, "_gmm_padded", fake("cooperative"))
  monkeypatch.setattr(mosaic_pingpong, "gmm_padded", fake("pingpong"))
  monkeypatch.setattr(mosaic_epilogue, "gmm_padded", fake("epilogue_wg"))
  topo = topology_for([rows_per_expert - 128, rows_per_expert - 128])
  return seen, topo, jnp.zeros((topo.num_row_blocks * 128, 128), jnp.bfloat16), jnp.zeros((2, 128, 256), jnp.bfloat16)


@pytest.mark.parametrize("rows_per_expert,epilogue_wg", [(1152, False), (2176, True)])
def test_mosaic_gmm_act_takes_the_epilogue_warpgroup_for_long_experts(monkeypatch, rows_per_expert, epilogue_wg):
  """gmm_act runs mosaic_epilogue's kernel (Configs.gmm_act_long) when experts average LONG_ROWS rows
  or more, the ping-pong kernel below; gmm_dact takes gmm_dact_long (the cooperative kernel) there,
  and the plain gmm its own config at every length."""
  seen, topo, lhs, w = _spy_on_gmm_schedules(monkeypatch, rows_per_expert, num_out=2)
  configs = mosaic.DEFAULT_CONFIGS
  want = configs.gmm_act_long if epilogue_wg else configs.gmm_act
  assert configs.gmm_for("gmm_act", lhs.shape[0], 2) == want
  assert configs.gmm_for("gmm_dact", lhs.shape[0], 2) == (configs.gmm_dact_long if epilogue_wg else configs.gmm_dact)
  assert configs.gmm_for("gmm", lhs.shape[0], 2) == configs.gmm
  jax.eval_shape(lambda l, w, t: mosaic.gmm_act(l, w, t, jax.nn.gelu, configs), lhs, w, topo)  # traced
  assert seen[0][0] == ("epilogue_wg" if epilogue_wg else "pingpong") and seen[0][1].epilogue_wg == epilogue_wg


@pytest.mark.parametrize("rows_per_expert,short", [(384, True), (1152, False)])
def test_mosaic_gmm_glu_takes_the_pingpong_kernel_for_short_experts(monkeypatch, rows_per_expert, short):
  """gmm_glu runs Configs.gmm_glu_short (the ping-pong kernel) when experts average fewer than
  SHORT_ROWS rows, gmm_glu (the cooperative kernel) from there on."""
  seen, topo, lhs, w = _spy_on_gmm_schedules(monkeypatch, rows_per_expert, num_out=3)
  configs = mosaic.DEFAULT_CONFIGS
  assert configs.gmm_for("gmm_glu", lhs.shape[0], 2) == (configs.gmm_glu_short if short else configs.gmm_glu)
  jax.eval_shape(lambda l, w, t: mosaic.gmm_glu(l, w, w, t, jax.nn.silu, configs), lhs, w, topo)  # traced
  assert [kernel for kernel, _ in seen] == ["pingpong" if short else "cooperative"]
