"""Expert parallelism on eight host devices: every layout equals the single-device layer.

Dropless mode must equal `moe_mlp` on the whole batch. Capacity mode must equal GShard's per-group
layer: `moe_mlp(..., capacity_factor)` run on each device's token shard (tokens are sharded in
contiguous blocks over (data, expert[, expert_slice]) in mesh order), concatenated.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import sparsejax as sj
from sparsejax import mesh as meshlib
from sparsejax import exchange, parallel
from sparsejax.parallel import ExpertParallelConfig, expert_parallel_moe_mlp

from moe_testing import np_capacity_keep

pytestmark = pytest.mark.devices(8)

T, D, F, K = 64, 8, 16, 2
TOL = dict(rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnums=(0, 1))  # one program, not a dozen small ones for each problem
def _routing(kind, num_experts, key):
  """uniform: random logits; skewed: most weight on experts 0 and 1; one: every token's first pick is expert E-1."""
  logits = jax.random.normal(key, (T, num_experts))
  if kind == "skewed":
    logits = logits + jnp.array([3.0, 2.0] + [0.0] * (num_experts - 2))
  if kind == "one":
    logits = logits.at[:, num_experts - 1].add(100.0)
  return sj.top_k_routing(logits, K)


@functools.lru_cache(maxsize=None)  # immutable arrays: the tests share each problem's draw
def _problem(kind="uniform", num_experts=8, glu=False, seed=0):
  ks = jax.random.split(jax.random.key(seed), 6)
  r = _routing(kind, num_experts, ks[0])
  x = jax.random.normal(ks[1], (T, D))
  w_in = jax.random.normal(ks[2], (num_experts, D, F)) / np.sqrt(D)
  w_out = jax.random.normal(ks[3], (num_experts, F, D)) / np.sqrt(F)
  w_gate = jax.random.normal(ks[4], (num_experts, D, F)) / np.sqrt(D) if glu else None
  g = jax.random.normal(ks[5], (T, D))  # cotangent: loss = <y, g>
  return x, r.expert_ids, r.combine_weights, w_in, w_out, w_gate, g


def _ids_moe_mlp_accepts(num_experts=8):
  """Expert ids a router would not give but moe_mlp computes: a token listing one expert twice
  (all on expert 0; each 8-token block twice on one expert), NO_EXPERT, and ids past the last
  expert. With one expert per device (E/P = 1 < k) the first two overflow a buffer sized for
  distinct ids."""
  rng = np.random.default_rng(3)
  block = (jnp.arange(T, dtype=jnp.int32) // 8) % num_experts
  return {
      "all_zero": jnp.zeros((T, K), jnp.int32),
      "block_twice": jnp.stack([block, block], axis=1),
      "random_repeats": jnp.asarray(rng.integers(-1, num_experts + 1, (T, K)), jnp.int32),
  }


def _single(x, ids, cw, w_in, w_out, w_gate, *, capacity_factor=None, shards=1):
  """The single-device answer: moe_mlp on the batch, or on each of `shards` token blocks (GShard
  groups); y, and the groups' tokens_per_expert and num_dropped summed."""
  parts = [sj.moe_mlp(xs, i, c, w_in, w_out, w_gate=w_gate, capacity_factor=capacity_factor)
           for xs, i, c in zip(jnp.split(x, shards), jnp.split(ids, shards), jnp.split(cw, shards))]
  counts = sum(s.tokens_per_expert for _, s in parts)
  return jnp.concatenate([y for y, _ in parts]), (counts, sum(s.num_dropped for _, s in parts))


@functools.lru_cache(maxsize=None)
def _jitted_value_and_grads(layer):
  """jit(value and gradients of <layer(...), g>), cached so that cases of one shape compile once."""
  def loss(x, cw, w_in, w_out, w_gate, ids, g):
    out = layer(x, ids, cw, w_in, w_out, w_gate)
    return jnp.sum(out[0] * g), out

  @jax.jit
  def run(x, ids, cw, w_in, w_out, w_gate, g):
    argnums = (0, 1, 2, 3) if w_gate is None else (0, 1, 2, 3, 4)
    # The layer's outputs ride along as aux: one trace of it serves the values and the gradients.
    grads, out = jax.grad(loss, argnums, has_aux=True)(x, cw, w_in, w_out, w_gate, ids, g)
    return out, grads
  return run


@functools.lru_cache(maxsize=None)
def _ep_layer(mesh, config, capacity_factor, impl="auto"):
  return lambda x, ids, cw, w_in, w_out, w_gate: expert_parallel_moe_mlp(
      x, ids, cw, w_in, w_out, w_gate=w_gate, mesh=mesh, parallel=config,
      capacity_factor=capacity_factor, impl=impl)


@functools.lru_cache(maxsize=None)
def _single_layer(capacity_factor, shards):
  return functools.partial(_single, capacity_factor=capacity_factor, shards=shards)


def _check_matches(mesh, problem, *, capacity_factor=None, config=ExpertParallelConfig(), shards=1,
                   impl="auto"):
  """y, gradients and statistics equal the single-device layer's; returns (y, stats)."""
  (y, stats), grads = _jitted_value_and_grads(_ep_layer(mesh, config, capacity_factor, impl))(*problem)
  (y_ref, (counts, dropped)), grads_ref = _jitted_value_and_grads(
      _single_layer(capacity_factor, shards))(*problem)
  np.testing.assert_allclose(y, y_ref, **TOL)
  for a, b in zip(grads, grads_ref):
    np.testing.assert_allclose(a, b, **TOL)
  np.testing.assert_array_equal(stats.tokens_per_expert, counts)
  assert int(stats.num_dropped) == int(dropped)
  # moe_mlp's definition: a fraction of the real assignments (NO_EXPERT slots are none).
  np.testing.assert_allclose(float(stats.dropped_fraction), int(dropped) / max(int(counts.sum()), 1),
                             rtol=1e-6)
  return y, stats


# ------------------------------------------------------------------------------------------------
# The pieces.


def test_peer_placement_sorts_by_peer_then_expert_then_token():
  ids = jnp.array([[3], [0], [1], [3], [2], [0]])  # 4 experts on 2 peers
  placement, sent = parallel.peer_placement(ids, 4, 2, slots=4)
  # Peer 0 holds experts 0, 1: rows [t1, t5, t2]; peer 1 holds 2, 3: rows [t4, t0, t3].
  np.testing.assert_array_equal(placement.rows[:, 0], [5, 0, 2, 6, 4, 1])
  np.testing.assert_array_equal(sent, [[2, 1], [1, 2]])
  assert int(placement.num_dropped) == 0


def test_peer_placement_counts_overflow_and_clips_sent_counts():
  ids = jnp.zeros((5, 1), jnp.int32)
  placement, sent = parallel.peer_placement(ids, 2, 2, slots=3)
  np.testing.assert_array_equal(placement.rows[:, 0], [0, 1, 2, 6, 6])
  np.testing.assert_array_equal(sent, [[3], [0]])
  assert int(placement.num_dropped) == 2


def test_received_token_routing_reads_the_packed_rows_and_no_expert_past_each_sources_rows():
  ids = np.array([[[3, 0], [1, 2], [9, 9]], [[2, 1], [7, 7], [7, 7]]], np.float32)  # 9, 7: padding rows
  weights = np.arange(12, dtype=np.float32).reshape(2, 3, 2) / 10
  got_ids, got_w = parallel.received_token_routing(jnp.asarray(np.concatenate([ids, weights], 2)),
                                                   jnp.array([2, 1]))
  np.testing.assert_array_equal(got_ids, [[3, 0], [1, 2], [-1, -1], [2, 1], [-1, -1], [-1, -1]])
  assert got_ids.dtype == jnp.int32
  np.testing.assert_array_equal(got_w, weights.reshape(6, 2))


def test_received_expert_ids():
  got = parallel.received_expert_ids(jnp.array([[1, 2], [0, 1]]), slots=4)
  np.testing.assert_array_equal(got, [0, 1, 1, -1, 1, -1, -1, -1])


def test_buffer_slots():
  assert parallel.buffer_slots(100, 2, 4, 8, None) == 200
  assert parallel.buffer_slots(100, 2, 4, 1, None) == 100  # distinct ids: one row per expert
  assert parallel.worst_slots(100, 2) == 200  # repeated ids: all of a token's k rows to one expert
  assert parallel.buffer_slots(100, 2, 4, 8, 1.25) == 63


def test_merge_repeats_sums_a_tokens_repeated_expert_into_its_first_column():
  ids = jnp.asarray([[2, 2, 0], [1, -1, 1], [3, 4, 3], [0, 1, 2]], jnp.int32)  # 4 experts: 4 is none
  w = jnp.asarray([[0.5, 0.25, 0.125], [0.5, 0.25, 0.125], [0.5, 0.25, 0.125], [0.5, 0.25, 0.125]], jnp.float32)
  got_ids, got_w = parallel.merge_repeats(ids, w, 4)
  np.testing.assert_array_equal(got_ids, [[2, -1, 0], [1, -1, -1], [3, -1, -1], [0, 1, 2]])
  np.testing.assert_array_equal(got_w, [[0.75, 0, 0.125], [0.625, 0, 0], [0.625, 0, 0], [0.5, 0.25, 0.125]])
  # d(sum of merged weights)/dw: every valid column counts once, through its expert's first column.
  grad = jax.grad(lambda w: jnp.sum(parallel.merge_repeats(ids, w, 4)[1]))(w)
  np.testing.assert_array_equal(grad, (ids >= 0) & (ids < 4))


def test_default_buffer_takes_no_fallback_cond():
  """E/P = 1 < k: the default buffer is the distinct-ids bound, below the worst case. With repeats merged it
  needs no overflow fallback, whose lax.cond cost the rounded E64 layer 20% (its branches' residuals); the
  rounded layer (k + 1 columns) neither; nor the token dispatch (T_local rows a peer). A buffer_factor
  buffer keeps its fallback."""
  mesh = meshlib.make_expert_mesh(1, 8)
  x, ids, cw, w_in, w_out, _, _ = _problem()
  probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (T, 8)))
  by_assignment = ExpertParallelConfig(dispatch="assignments")
  layers = {
      "dropless": lambda x, w_in: expert_parallel_moe_mlp(x, ids, cw, w_in, w_out, mesh=mesh,
                                                          parallel=by_assignment)[0],
      "rounded": lambda x, w_in: sj.rounded_moe_mlp(
          x, sj.TokenChoiceRouting(ids, cw, probs, probs), w_in, w_out, mesh=mesh, parallel=by_assignment)[0],
      "tokens": lambda x, w_in: expert_parallel_moe_mlp(x, ids, cw, w_in, w_out, mesh=mesh, parallel=TOKENS)[0],
      "buffer_factor": lambda x, w_in: expert_parallel_moe_mlp(
          x, ids, cw, w_in, w_out, mesh=mesh, parallel=ExpertParallelConfig(buffer_factor=1.0))[0],
  }
  for name, layer in layers.items():
    text = jax.jit(jax.grad(lambda x, w_in: jnp.sum(layer(x, w_in)), argnums=(0, 1))).lower(x, w_in).as_text()
    conds = text.count("stablehlo.case") + text.count("stablehlo.if")
    assert (conds > 0) == (name == "buffer_factor"), (name, conds)


def test_exchange_overflow_counts_rows_past_the_buffer():
  ids = jnp.zeros((5, 2), jnp.int32)  # ten rows for peer 0 (expert 0), none for peer 1
  assert int(parallel.exchange_overflow(ids, 2, 2, slots=3)) == 7
  assert int(parallel.exchange_overflow(ids, 2, 2, slots=10)) == 0
  ids = jnp.asarray([[0, 3], [1, -1], [2, 3]], jnp.int32)  # NO_EXPERT is no row
  assert int(parallel.exchange_overflow(ids, 4, 2, slots=2)) == 1


# ------------------------------------------------------------------------------------------------
# Equivalence with one device.

MESHES = [(1, 8), (2, 4), (4, 2)]


KINDS = ["uniform", "skewed", "one"]  # looped inside a test, so that the three share one compile


@pytest.mark.parametrize("dispatch", ["assignments", "tokens"])
@pytest.mark.parametrize("shape", MESHES)
def test_dropless_matches_single_device(shape, dispatch):
  """A row an assignment, or a row a (token, peer) pair summed on the peer."""
  mesh = meshlib.make_expert_mesh(*shape)
  config = ExpertParallelConfig(dispatch=dispatch)
  for kind in KINDS:
    _check_matches(mesh, _problem(kind), config=config)
  # Ids moe_mlp accepts that a router would not give (same compile). On (1, 8), E/P = 1 < k: the
  # default buffer holds distinct ids, so a token's repeats are merged first (merge_repeats); the token
  # dispatch merges them too, so that a peer's columns hold all of a token's experts there.
  x, _, cw, w_in, w_out, w_gate, g = _problem()
  for name, ids in _ids_moe_mlp_accepts().items():
    _, stats = _check_matches(mesh, (x, ids, cw, w_in, w_out, w_gate, g), config=config)
    assert int(stats.exchange_overflow) == 0, name


@pytest.mark.parametrize("shape", MESHES)
def test_capacity_matches_per_device_groups(shape):
  for kind in KINDS:
    y, stats = _check_matches(meshlib.make_expert_mesh(*shape), _problem(kind), capacity_factor=1.0,
                              shards=8)
    if kind == "one":  # the mode really drops: tokens past capacity get nothing from expert E-1
      dropless = _jitted_value_and_grads(_single_layer(None, 1))(*_problem(kind))[0][0]
      assert not np.allclose(y, dropless, atol=1e-3)
      assert int(stats.num_dropped) > 0


def test_capacity_stats_count_global_drops():
  x, ids, cw, w_in, w_out, w_gate, g = _problem("one")
  ids = ids.at[::3, 1].set(sj.NO_EXPERT)  # empty slots: neither dropped nor in the fraction's denominator
  _, stats = _check_matches(meshlib.make_expert_mesh(2, 4), (x, ids, cw, w_in, w_out, w_gate, g),
                            capacity_factor=1.0, shards=8)
  # And by a numpy count: GShard groups of 8 tokens, C = ceil(1.0 * 8 * 2 / 8) = 2.
  ids_np = np.asarray(ids)
  dropped = sum(int(((b >= 0) & ~np_capacity_keep(b, 8, 2)).sum()) for b in np.split(ids_np, 8))
  real = ids_np[ids_np >= 0]
  assert int(stats.num_dropped) == dropped > 0
  np.testing.assert_array_equal(stats.tokens_per_expert, np.bincount(real, minlength=8))
  np.testing.assert_allclose(float(stats.dropped_fraction), dropped / real.size, rtol=1e-6)


def test_glu_experts():
  _check_matches(meshlib.make_expert_mesh(2, 4), _problem("skewed", glu=True))


def test_sixteen_experts_two_per_device():
  _check_matches(meshlib.make_expert_mesh(1, 8), _problem("skewed", num_experts=16))


def test_pallas_kernels_inside_shard_map():
  # The GPU path (block-padded rows, one topology, the Pallas kernels; interpret mode here) under
  # shard_map, whose varying-axes check pallas_call outputs cannot pass, so it runs unchecked:
  # this test is what guards its gradients (w_in/w_out are replicated over "data" and need a psum).
  _check_matches(meshlib.make_expert_mesh(2, 4), _problem("skewed"), impl="pallas",
                 config=ExpertParallelConfig(buffer_factor=1.0, dispatch="assignments"))


def test_token_chunks_match_single_device():
  # Each device's 8 tokens in chunks with their own placement, exchange and products. Four where
  # the layer compiles one branch, two under the overflow fallback, whose cond compiles both (the
  # chunks are unrolled, so a compile grows with their number).
  chunked = ExpertParallelConfig(token_chunks=4)
  for kind in KINDS:
    _check_matches(meshlib.make_expert_mesh(2, 4), _problem(kind), config=chunked)
  # A small buffer that overflows: the exact fallback runs chunk by chunk too; and the ragged exchange.
  x, _, cw, w_in, w_out, _, g = _problem()
  ids = _ids_moe_mlp_accepts()["all_zero"]
  _, stats = _check_matches(meshlib.make_expert_mesh(1, 8), (x, ids, cw, w_in, w_out, None, g),
                            config=ExpertParallelConfig(token_chunks=2, buffer_factor=1.0, dispatch="assignments"))
  assert int(stats.exchange_overflow) > 0 and int(stats.num_dropped) == 0
  _check_matches(meshlib.make_expert_mesh(1, 8), _problem("skewed"),
                 config=ExpertParallelConfig(token_chunks=2, exchange="ragged"))
  # The GPU path (block-padded rows and the Pallas kernels, interpreted) chunk by chunk, on the
  # default buffer: a small one would overflow here and run this same worst-case branch, after
  # compiling a second that never runs (test_pallas_kernels_inside_shard_map has the fallback).
  _check_matches(meshlib.make_expert_mesh(2, 4), _problem("skewed"), impl="pallas",
                 config=ExpertParallelConfig(token_chunks=2))


def test_bad_token_chunks_are_refused():
  x, ids, cw, w_in, w_out, _, _ = _problem()
  mesh = meshlib.make_expert_mesh(1, 8)
  for bad in (0, 1.5, True):
    with pytest.raises(ValueError, match="token_chunks must be a positive int"):
      ExpertParallelConfig(token_chunks=bad)
  with pytest.raises(ValueError, match="do not split into token_chunks=3"):
    expert_parallel_moe_mlp(x, ids, cw, w_in, w_out, mesh=mesh, parallel=ExpertParallelConfig(token_chunks=3))
  with pytest.raises(ValueError, match="dropless layer"):
    expert_parallel_moe_mlp(x, ids, cw, w_in, w_out, mesh=mesh, capacity_factor=1.0,
                            parallel=ExpertParallelConfig(token_chunks=2))


# ------------------------------------------------------------------------------------------------
# The buffer bound: overflow falls back or raises, never drops.


def test_small_buffer_falls_back_exactly_on_overflow():
  mesh = meshlib.make_expert_mesh(1, 8)
  config = ExpertParallelConfig(buffer_factor=1.0, dispatch="assignments")
  x, _, cw, w_in, w_out, _, g = _problem()
  routings = {"one": _problem("one")[1], **_ids_moe_mlp_accepts()}
  for name, ids in routings.items():
    _, stats = _check_matches(mesh, (x, ids, cw, w_in, w_out, None, g), config=config)
    assert int(stats.exchange_overflow) > 0, name  # the fallback really was needed
    assert int(stats.num_dropped) == 0, name


def test_small_buffer_without_overflow_takes_the_fast_path():
  # Perfectly balanced routing: token t picks experts t % 8 and (t + 1) % 8, two per token.
  x, _, cw, w_in, w_out, _, g = _problem()
  ids = jnp.stack([jnp.arange(T) % 8, (jnp.arange(T) + 1) % 8], axis=1).astype(jnp.int32)
  mesh = meshlib.make_expert_mesh(1, 8)
  config = ExpertParallelConfig(buffer_factor=1.0, dispatch="assignments")
  _, stats = _check_matches(mesh, (x, ids, cw, w_in, w_out, None, g), config=config)
  assert int(stats.exchange_overflow) == 0


def _forget_failed_call():
  """jax keeps a failed call's runtime token and re-raises it at interpreter exit; forget it (private API,
  test hygiene only)."""
  try:
    from jax._src import dispatch
    dispatch.runtime_tokens.clear()
  except (ImportError, AttributeError):
    pass


def test_small_buffer_raises_on_overflow():
  mesh = meshlib.make_expert_mesh(2, 4)
  config = ExpertParallelConfig(buffer_factor=1.0, dispatch="assignments", on_overflow="raise")
  x, ids, cw, w_in, w_out, _, _ = _problem("one")
  f = jax.jit(lambda *a: expert_parallel_moe_mlp(*a, mesh=mesh, parallel=config)[0])
  with pytest.raises(Exception, match="overflow"):
    jax.block_until_ready(f(x, ids, cw, w_in, w_out))
  _forget_failed_call()
  # Balanced routing fits and does not raise.
  balanced = jnp.stack([jnp.arange(T) % 8, (jnp.arange(T) + 1) % 8], axis=1).astype(jnp.int32)
  y = jax.block_until_ready(f(x, balanced, cw, w_in, w_out))
  np.testing.assert_allclose(y, jax.jit(_single)(x, balanced, cw, w_in, w_out, None)[0], **TOL)


# ------------------------------------------------------------------------------------------------
# Hierarchical all-to-all and expert slicing.


@pytest.mark.parametrize("shape,capacity_factor,hierarchical", [
    ((1, 2, 4), None, True), ((2, 2, 2), None, True), ((1, 2, 4), 1.0, True), ((2, 2, 2), 1.0, True),
    ((2, 2, 2), None, False),  # one all-to-all over both axes
])
def test_two_level_expert_axis(shape, capacity_factor, hierarchical):
  data, groups, expert = shape
  mesh = meshlib.make_expert_mesh(data, expert, expert_groups=groups)
  config = ExpertParallelConfig(expert_axis=(meshlib.EXPERT_GROUP, meshlib.EXPERT),
                                hierarchical=hierarchical)
  problem = _problem("skewed")
  _check_matches(mesh, problem, capacity_factor=capacity_factor, config=config,
                 shards=1 if capacity_factor is None else 8)
  if capacity_factor is None:  # repeated ids, merged to fit the distinct-ids buffer; same compile
    x, _, cw, w_in, w_out, w_gate, g = problem
    _check_matches(mesh, (x, _ids_moe_mlp_accepts()["block_twice"], cw, w_in, w_out, w_gate, g),
                   config=config)


@pytest.mark.parametrize("shape,num_experts,capacity_factor", [
    ((1, 8), 2, None), ((1, 8), 2, 1.0), ((2, 4), 2, None), ((1, 8), 4, 1.0),
])
def test_expert_slicing(shape, num_experts, capacity_factor):
  mesh = meshlib.make_expert_mesh(*shape)
  layout = meshlib.expert_layout(mesh, num_experts)
  assert layout.num_slices == shape[1] // num_experts
  problem = _problem("skewed", num_experts=num_experts, glu=True)
  shards = 1 if capacity_factor is None else 8
  _check_matches(mesh, problem, capacity_factor=capacity_factor, shards=shards)
  # Repeated ids (E/P = 1 < k: merged to fit the distinct-ids buffer, under slicing), with the same compile.
  x, _, cw, w_in, w_out, w_gate, g = problem
  ids = _ids_moe_mlp_accepts(num_experts)["block_twice"]
  _check_matches(mesh, (x, ids, cw, w_in, w_out, w_gate, g), capacity_factor=capacity_factor,
                 shards=shards)


def test_bad_layouts_are_refused():
  with pytest.raises(ValueError, match="divide"):
    meshlib.expert_layout(meshlib.make_expert_mesh(1, 8), 12)
  with pytest.raises(ValueError, match="hierarchical"):
    ExpertParallelConfig(hierarchical=True)
  x, ids, cw, w_in, w_out, _, _ = _problem()
  with pytest.raises(ValueError, match="split over"):
    expert_parallel_moe_mlp(x[:60], ids[:60], cw[:60], w_in, w_out, mesh=meshlib.make_expert_mesh(1, 8))


# ------------------------------------------------------------------------------------------------
# The ragged exchange (real rows only). XLA:CPU lacks ragged-all-to-all, so here it runs the dense
# emulation: these tests check its offsets and sizes; tests/gpu runs the real op.


def _shard_mapped(f, mesh, axis, n_in):
  spec = jax.sharding.PartitionSpec(axis)
  return jax.jit(parallel._shard_map(f, mesh, (spec,) * n_in, spec))


def test_ragged_reference_is_jax_ragged_all_to_all():
  """The two-device example of jax.lax.ragged_all_to_all's docstring, and a random case against a
  numpy loop over its pseudocode."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("e",))
  ref = lambda *a: exchange.ragged_all_to_all_reference(*a, axis_name="e")
  got = _shard_mapped(ref, mesh, "e", 6)(
      jnp.array([1, 2, 2, 3, 4, 0]), jnp.zeros(8, jnp.int32), jnp.array([0, 1, 0, 1]),
      jnp.array([1, 2, 1, 1]), jnp.array([0, 0, 1, 2]), jnp.array([1, 1, 2, 1]))
  np.testing.assert_array_equal(got, [1, 3, 0, 0, 2, 2, 4, 0])

  p, n = 8, 6
  rng = np.random.default_rng(0)
  sizes = rng.integers(0, 3, (p, p))  # sizes[i, j]: rows i sends j
  operand = rng.normal(size=(p, n, 3)).astype(np.float32)
  output = rng.normal(size=(p, 2 * p + 2, 3)).astype(np.float32)  # untouched rows keep their values
  in_off = np.array([[rng.integers(0, n - sizes[i, j] + 1) for j in range(p)] for i in range(p)])
  out_off = np.zeros((p, p), np.int64)  # where i's rows land on j: stacked by sender on each j
  for j in range(p):
    out_off[:, j] = np.concatenate([[0], np.cumsum(sizes[:, j])[:-1]]) + 1
  want = output.copy()
  for i in range(p):
    for j in range(p):
      want[j, out_off[i, j]:out_off[i, j] + sizes[i, j]] = operand[i, in_off[i, j]:in_off[i, j] + sizes[i, j]]
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("e",))
  flat = lambda a: jnp.asarray(a.reshape(p * a.shape[1], *a.shape[2:]))
  got = _shard_mapped(ref, mesh, "e", 6)(flat(operand), flat(output), flat(in_off.astype(np.int32)),
                                         flat(sizes.astype(np.int32)), flat(out_off.astype(np.int32)),
                                         flat(sizes.T.astype(np.int32)))
  np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)


# The block send (COMPACT: the default), a row an assignment (the token dispatch has its own test below).
RAGGED = ExpertParallelConfig(exchange="ragged", compact_send=False, dispatch="assignments")


def test_ragged_exchange_matches_single_device():
  mesh = meshlib.make_expert_mesh(1, 8)
  for kind in KINDS:
    _check_matches(mesh, _problem(kind), config=RAGGED)
  # E/P = 1 < k: repeated ids, merged to fit the distinct-ids buffer, through the ragged exchange.
  x, _, cw, w_in, w_out, w_gate, g = _problem()
  _check_matches(mesh, (x, _ids_moe_mlp_accepts()["block_twice"], cw, w_in, w_out, w_gate, g), config=RAGGED)


COMPACT = ExpertParallelConfig(exchange="ragged", compact_send=True, ragged_chunks=3, dispatch="assignments")


def test_compact_send_matches_single_device():
  """The ragged exchange from a send buffer without the blocks' padding (rows in 3 uneven updates):
  every routing, repeated ids merged into the distinct-ids buffer, a
  small buffer_factor that overflows, two token chunks, two expert axes and expert slices."""
  mesh = meshlib.make_expert_mesh(1, 8)
  for kind in KINDS:
    _check_matches(mesh, _problem(kind), config=COMPACT)
  x, _, cw, w_in, w_out, w_gate, g = _problem()
  _check_matches(mesh, (x, _ids_moe_mlp_accepts()["block_twice"], cw, w_in, w_out, w_gate, g), config=COMPACT)
  _check_matches(meshlib.make_expert_mesh(2, 4), _problem("skewed"),
                 config=dataclasses.replace(COMPACT, buffer_factor=0.5, token_chunks=2))
  _check_matches(meshlib.make_expert_mesh(2, 2, expert_groups=2), _problem("skewed"),
                 config=dataclasses.replace(COMPACT, expert_axis=(meshlib.EXPERT_GROUP, meshlib.EXPERT)))
  _check_matches(meshlib.make_expert_mesh(1, 8), _problem("skewed", num_experts=2, glu=True), config=COMPACT)


def test_compact_send_placement_drops_the_blocks_padding():
  ids = jnp.array([[3], [0], [2], [3], [1], [3]])  # 4 experts on 2 peers (2 each), S = 2 slots a peer
  block, sent = parallel.peer_placement(ids, 4, 2, slots=2)
  compact, offsets = parallel.compact_send_placement(block, sent.sum(axis=1), slots=2)
  # Peer 0 gets expert 0's and 1's rows (tokens 1, 4); peer 1, sorted by expert then token, holds
  # tokens 2 (expert 2) and 0 (expert 3) in its S = 2 slots, and tokens 3 and 5 are not sent.
  np.testing.assert_array_equal(offsets, [0, 2])
  assert compact.num_rows == 6
  np.testing.assert_array_equal(compact.rows[:, 0], [3, 0, 2, 6, 1, 6])  # 6: not sent
  np.testing.assert_array_equal(compact.rows < 6, block.rows < 4)


def test_ragged_exchange_over_two_axes_and_expert_slices():
  # One exchange over both expert axes (flattened peer index); expert slicing (sizes before the gather).
  mesh = meshlib.make_expert_mesh(2, 2, expert_groups=2)
  _check_matches(mesh, _problem("skewed"), config=ExpertParallelConfig(  # blocks in 3 uneven updates
      expert_axis=(meshlib.EXPERT_GROUP, meshlib.EXPERT), exchange="ragged", ragged_chunks=3,
      compact_send=False))
  _check_matches(meshlib.make_expert_mesh(1, 8), _problem("skewed", num_experts=2, glu=True), config=RAGGED)


TOKENS = ExpertParallelConfig(dispatch="tokens")


def test_peer_token_placement_sends_a_token_once_a_peer():
  # 8 experts on 2 peers (4 each); token 0 uses both peers, token 1 peer 0 twice, token 2 only NO_EXPERT,
  # token 3 peer 1 once (and an id past the last expert).
  ids = jnp.array([[1, 6], [0, 3], [-1, -1], [9, 5]])
  send, sent = parallel.peer_token_placement(ids, 8, 2)
  np.testing.assert_array_equal(sent, [2, 2])
  np.testing.assert_array_equal(send.rows, [[0, 4], [1, 8], [8, 8], [8, 5]])  # row p*T + rank; 8: none
  local, weights = parallel.peer_local_routing(ids, jnp.array([[.1, .2], [.3, .4], [.5, .6], [.7, .8]]), 8, 2)
  np.testing.assert_array_equal(local, [[[1, -1], [2, -1]], [[0, 3], [-1, -1]], [[-1, -1], [-1, -1]],
                                        [[-1, -1], [1, -1]]])
  np.testing.assert_allclose(weights, [[[.1, 0], [.2, 0]], [[.3, .4], [0, 0]], [[0, 0], [0, 0]],
                                       [[0, 0], [.8, 0]]], rtol=1e-6)
  # E/P = 1 < k: a peer's width is one column.
  assert parallel.peer_local_routing(ids, jnp.ones((4, 2)), 8, 8)[0].shape == (4, 8, 1)


def test_token_dispatch_through_every_exchange_and_layout():
  """Ragged (block and compact, 3 uneven updates), two token chunks, two expert axes in one and two
  stages, expert slicing with GLU (E < P), k = E, and the Pallas kernels (interpreted) inside shard_map."""
  skewed = _problem("skewed")
  mesh = meshlib.make_expert_mesh(1, 8)
  _check_matches(mesh, skewed, config=dataclasses.replace(RAGGED, dispatch="tokens"))
  _check_matches(meshlib.make_expert_mesh(2, 4), skewed,
                 config=dataclasses.replace(COMPACT, dispatch="tokens", token_chunks=2))
  for hierarchical in (False, True):
    _check_matches(meshlib.make_expert_mesh(2, 2, expert_groups=2), skewed, config=ExpertParallelConfig(
        expert_axis=(meshlib.EXPERT_GROUP, meshlib.EXPERT), hierarchical=hierarchical, dispatch="tokens"))
  _check_matches(mesh, _problem("skewed", num_experts=2, glu=True), config=TOKENS)  # k = E, sliced d_ff
  _check_matches(meshlib.make_expert_mesh(2, 4), skewed, impl="pallas", config=TOKENS)


def test_token_dispatch_in_bf16():
  """bf16: each peer's partial sum is rounded once more, so top-2 meets moe_mlp within bf16's tolerance; top-1
  (one weighted output a token) equals the assignment dispatch bit for bit, gradients too."""
  mesh = meshlib.make_expert_mesh(1, 8)
  x, ids, cw, w_in, w_out, _, g = _problem("skewed", num_experts=16)
  bf = lambda a: a.astype(jnp.bfloat16)
  x, w_in, w_out, g = bf(x), bf(w_in), bf(w_out), bf(g)

  def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.max(np.abs(a - b)) / np.max(np.abs(b))

  by_token, _ = _jitted_value_and_grads(_ep_layer(mesh, TOKENS, None))(x, ids, cw, w_in, w_out, None, g)
  want, _ = _jitted_value_and_grads(_single_layer(None, 1))(x, ids, cw, w_in, w_out, None, g)
  assert rel(by_token[0], want[0]) < 1e-2
  top1 = (x, ids[:, :1], cw[:, :1], w_in, w_out, None, g)
  (y_token, _), grads_token = _jitted_value_and_grads(_ep_layer(mesh, TOKENS, None))(*top1)
  (y_row, _), grads_row = _jitted_value_and_grads(
      _ep_layer(mesh, ExpertParallelConfig(dispatch="assignments"), None))(*top1)
  np.testing.assert_array_equal(np.asarray(y_token, np.float32), np.asarray(y_row, np.float32))
  for a, b in zip(grads_token, grads_row):  # the same rows in the same order reach each expert's products
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_token_dispatch_moves_fewer_rows_for_top_k():
  """The point of it: the dense exchange's blocks hold T_local rows, not T_local * min(k, E/P)."""
  x, ids, cw, w_in, w_out, w_gate, g = _problem()
  layer = lambda config: jax.jit(lambda x, ids, cw, w_in, w_out: expert_parallel_moe_mlp(
      x, ids, cw, w_in, w_out, mesh=meshlib.make_expert_mesh(1, 2), parallel=config)[0])
  # The all_to_all results' types in the traced program, e.g. "f32[2,64,8]".
  shapes = lambda config: set(re.findall(r"(\w+\[[\d,]+\])(?:\{[^}]*\})? = all_to_all", str(
      jax.make_jaxpr(layer(config))(x, ids, cw, w_in, w_out))))
  # 32 tokens a device, k = 2, 4 experts a peer: blocks of 32 * 2 assignment rows, or 32 token rows.
  by_assignment = ExpertParallelConfig(dispatch="assignments")
  assert {"f32[2,64,8]"} <= shapes(by_assignment) and "f32[2,32,8]" not in shapes(by_assignment)
  assert {"f32[2,32,8]"} <= shapes(TOKENS) and "f32[2,64,8]" not in shapes(TOKENS)


@pytest.mark.parametrize("peers,want", [(2, "dense"), (8, "ragged")])
def test_auto_exchange_takes_the_layouts_peer_count(monkeypatch, peers, want):
  """The layer resolves "auto" with its all-to-all group's size: on a platform with ragged-all-to-all
  (here the resolver is told "gpu"; the exchange itself still emulates on the CPU), 8 peers take the
  ragged exchange and 2 the dense one, and either equals the single-device layer."""
  monkeypatch.setattr(parallel, "exchange_platform", lambda layout: "gpu")
  calls = []
  for name in ("ragged_all_to_all_rows", "ragged_rows"):  # the block send's and the compact send's
    real = getattr(parallel, name)
    monkeypatch.setattr(parallel, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
  _jitted_value_and_grads.cache_clear()
  _check_matches(meshlib.make_expert_mesh(8 // peers, peers), _problem("skewed"))
  _jitted_value_and_grads.cache_clear()
  assert bool(calls) == (want == "ragged")


def test_received_rows():
  # 8 peers x 16 tokens received, k = 2 of 16 experts (width 2): 256 at worst, mean 32 a receiver.
  assert parallel.received_rows(128, 2, 8, 2, None) == 256
  assert parallel.received_rows(128, 2, 8, 2, 1.0) == 32
  assert parallel.received_rows(128, 2, 8, 2, 1.3) == 42  # ceil(41.6)
  assert parallel.received_rows(128, 2, 8, 2, 100.0) == 256  # never past the worst case
  assert parallel.received_rows(128, 2, 8, 2, 1e-6) == 1


def test_token_dispatch_small_buffer_falls_back_exactly_on_overflow():
  """buffer_factor with the token dispatch bounds the rows a receiver computes (f times the mean); a routing
  past it takes the fallback, exactly, and counts each receiver's excess once; one that fits (each receiver
  exactly at the mean, so at the bound) takes the small buffer. Also under token chunks, two expert axes and
  expert slices, where the receivers' counts are summed over more devices."""
  config = ExpertParallelConfig(dispatch="tokens", buffer_factor=1.0)
  x, _, cw, w_in, w_out, _, g = _problem()
  mesh = meshlib.make_expert_mesh(1, 8)
  routings = {"one": _problem("one")[1], **_ids_moe_mlp_accepts()}
  for name, ids in routings.items():
    _, stats = _check_matches(mesh, (x, ids, cw, w_in, w_out, None, g), config=config)
    merged = np.asarray(parallel.merge_repeats(ids, cw, 8)[0])
    received = np.bincount(merged[merged >= 0], minlength=8)  # one expert a device
    want = np.maximum(received - T * K // 8, 0).sum()
    assert int(stats.exchange_overflow) == want, name
    assert int(stats.num_dropped) == 0, name
    assert want > 0 or name not in ("one", "all_zero")  # these two must take the fallback
  balanced = jnp.stack([jnp.arange(T) % 8, (jnp.arange(T) + 1) % 8], axis=1).astype(jnp.int32)
  _, stats = _check_matches(mesh, (x, balanced, cw, w_in, w_out, None, g), config=config)
  assert int(stats.exchange_overflow) == 0
  skewed = _problem("skewed")
  _check_matches(meshlib.make_expert_mesh(2, 4), skewed, config=dataclasses.replace(COMPACT, dispatch="tokens",
                                                                                   buffer_factor=1.0, token_chunks=2))
  _check_matches(meshlib.make_expert_mesh(2, 2, expert_groups=2), skewed, config=dataclasses.replace(
      config, expert_axis=(meshlib.EXPERT_GROUP, meshlib.EXPERT), hierarchical=True))
  sliced = _problem("skewed", num_experts=2, glu=True)  # 2 experts on 8 devices: 4 slices each
  _, stats = _check_matches(mesh, sliced, config=config)
  merged = np.asarray(parallel.merge_repeats(sliced[1], sliced[2], 2)[0])
  want = np.maximum(np.bincount(merged[merged >= 0], minlength=2) - T * K // 2, 0).sum()
  assert int(stats.exchange_overflow) == want  # counted once a receiver, not once a slice
  balanced_sliced = (x, jnp.stack([jnp.arange(T) % 2, (jnp.arange(T) + 1) % 2], axis=1).astype(jnp.int32),
                     *sliced[2:])
  _, stats = _check_matches(mesh, balanced_sliced, config=config)
  assert int(stats.exchange_overflow) == 0


def test_token_dispatch_small_buffer_raises_on_overflow():
  """Raised, the call's products still run (through the Pallas kernels here): on the first `bound` received
  assignments, which the placement's buffer holds, not past it."""
  config = ExpertParallelConfig(dispatch="tokens", buffer_factor=1.0, on_overflow="raise")
  x, ids, cw, w_in, w_out, _, _ = _problem("one")
  f = jax.jit(lambda *a: expert_parallel_moe_mlp(*a, mesh=meshlib.make_expert_mesh(2, 4), parallel=config,
                                                 impl="pallas")[0])
  with pytest.raises(Exception, match="overflow"):
    jax.block_until_ready(f(x, ids, cw, w_in, w_out))
  _forget_failed_call()
  ids = jnp.array([[0, 1], [-1, 2], [1, 4], [0, 2]])  # 4: no expert of 4
  np.testing.assert_array_equal(parallel.first_assignments(ids, 4, 3), [[0, 1], [-1, 2], [-1, -1], [-1, -1]])
  np.testing.assert_array_equal(parallel.first_assignments(ids, 4, 6), [[0, 1], [-1, 2], [1, -1], [0, 2]])


def test_small_buffer_saves_training_memory():
  """What a buffer_factor is for: in a stack of layers under autodiff, the smaller buffers' residuals. The
  fallback is rematerialized; kept by the cond, its worst-case residuals made the program larger than with
  no buffer_factor at all (67.6 against 49.2 MiB here; with remat 27.7)."""
  tokens, experts, layers = 1024, 16, 4
  ks = jax.random.split(jax.random.key(1), 4)
  r = sj.top_k_routing(jax.random.normal(ks[0], (tokens, experts)), K)
  x = jax.random.normal(ks[1], (tokens, 64))
  w_in = jax.random.normal(ks[2], (layers, experts, 64, 256))
  w_out = jax.random.normal(ks[3], (layers, experts, 256, 64))
  mesh = meshlib.make_expert_mesh(1, 8)

  def temp_bytes(config):
    def loss(x, w_in, w_out):
      for i in range(layers):
        x = x + expert_parallel_moe_mlp(x, r.expert_ids, r.combine_weights, w_in[i], w_out[i], mesh=mesh,
                                        parallel=config)[0]
      return jnp.sum(x)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w_in, w_out).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  safe = temp_bytes(ExpertParallelConfig(dispatch="tokens"))  # the assignment dispatch's: the same size
  for dispatch in ("tokens", "assignments"):
    small = temp_bytes(ExpertParallelConfig(dispatch=dispatch, buffer_factor=1.0))
    assert small < 0.7 * safe, (dispatch, small, safe)


def test_exchange_choice_and_bad_options():
  with pytest.raises(ValueError, match="dispatch must be one of"):
    ExpertParallelConfig(dispatch="rows")
  assert ExpertParallelConfig().dropless_dispatch == "tokens"
  assert ExpertParallelConfig(buffer_factor=1.0).dropless_dispatch == "tokens"
  choose = lambda ex, peers, platform="gpu", hierarchical=False: exchange.resolve_exchange(
      ex, hierarchical, num_peers=peers, platform=platform)
  # "auto": dense on 2 GPUs (where it measured faster), ragged from 4 (where it did), dense on the
  # CPU (an emulation there) and for the two-stage exchange (single-stage only).
  assert [choose("auto", p) for p in (2, 3, 4, 8)] == ["dense", "dense", "ragged", "ragged"]
  assert choose("auto", 8, "tpu") == "ragged" and choose("auto", 8, "cpu") == "dense"
  assert choose("auto", 8, hierarchical=True) == "dense"
  assert choose("ragged", 2, "cpu") == "ragged" and choose("dense", 8) == "dense"
  with pytest.raises(ValueError, match="ragged_chunks"):
    ExpertParallelConfig(exchange="ragged", ragged_chunks=0)
  with pytest.raises(ValueError, match="compact_send is a form of the ragged exchange"):
    ExpertParallelConfig(exchange="dense", compact_send=True)
  ExpertParallelConfig(exchange="auto", compact_send=True)  # it applies where auto resolves to ragged
  with pytest.raises(ValueError, match="exchange must be one of"):
    ExpertParallelConfig(exchange="nccl")
  with pytest.raises(ValueError, match="single-stage"):
    ExpertParallelConfig(expert_axis=(meshlib.EXPERT_GROUP, meshlib.EXPERT), hierarchical=True,
                         exchange="ragged")


# ------------------------------------------------------------------------------------------------
# The module, and a training step.


def _modules(config, mesh, parallel_config=None):
  single = sj.MoE(config, rngs=nnx.Rngs(0))
  sharded = sj.MoE(config, rngs=nnx.Rngs(0), mesh=mesh, parallel=parallel_config)
  return single, sharded


def _shard_module(model, mesh, num_experts):
  layout = meshlib.expert_layout(mesh, num_experts)
  state = nnx.state(model, nnx.Param)
  shardings = meshlib.param_shardings(nnx.get_partition_spec(state), layout)
  nnx.update(model, jax.device_put(state, shardings))
  return layout


def test_module_with_mesh_matches_single_device():
  config = sj.MoEConfig(d_model=D, d_ff=F, num_experts=4, top_k=2, glu=True)
  mesh = meshlib.make_expert_mesh(2, 4)
  single, sharded = _modules(config, mesh)
  _shard_module(sharded, mesh, 4)
  x = jax.random.normal(jax.random.key(7), (4, 16, D))
  y0, s0 = nnx.jit(lambda m, x: m(x))(single, x)
  y1, s1 = nnx.jit(lambda m, x: m(x))(sharded, x)
  np.testing.assert_allclose(y1, y0, **TOL)
  np.testing.assert_allclose(s1.aux_loss, s0.aux_loss, **TOL)
  np.testing.assert_array_equal(s1.tokens_per_expert, s0.tokens_per_expert)


@pytest.mark.parametrize("shape,num_experts", [((2, 4), 8), ((1, 8), 2)])
def test_jitted_train_step_with_sharded_params_and_optax_state(shape, num_experts):
  config = sj.MoEConfig(d_model=D, d_ff=F, num_experts=num_experts, top_k=1)
  mesh = meshlib.make_expert_mesh(*shape)
  single, sharded = _modules(config, mesh)
  layout = _shard_module(sharded, mesh, num_experts)
  x = jax.random.normal(jax.random.key(1), (T, D))
  target = jax.random.normal(jax.random.key(2), (T, D))
  x_sharded = jax.device_put(x, layout.sharding(layout.tokens))
  tx = optax.adam(1e-2)

  def run(model, x, steps=3):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x):
      def loss_fn(p):
        y, stats = nnx.merge(graphdef, p, rest)(x)
        return jnp.mean((y - target) ** 2) + stats.aux_loss
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
      params, opt_state, loss = step(params, opt_state, x)
      losses.append(loss)
    return params, opt_state, jnp.stack(losses)

  p0, _, l0 = run(single, x)
  p1, o1, l1 = run(sharded, x_sharded)
  np.testing.assert_allclose(l1, l0, **TOL)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  # Parameters and Adam moments stay sharded over the experts.
  expert_leaves = [a for a in jax.tree.leaves(o1) if getattr(a, "ndim", 0) == 3]
  assert expert_leaves and all(
      a.sharding.spec[0] is not None and len(a.addressable_shards) == 8 for a in expert_leaves)
  assert all(a.addressable_shards[0].data.shape[0] == max(1, num_experts // shape[1])
             for a in expert_leaves)


def test_precision_and_float32_combine_weights():
  """float32 experts ask for HIGHEST in every product (no TF32 on GPU); bf16 experts with float32
  combine weights are accepted (the weights stay float32) and keep the default precision."""
  from moe_testing import dot_precisions, is_highest

  mesh = meshlib.make_expert_mesh(1, 8)
  x, ids, cw, w_in, w_out, _, _ = _problem()
  for cf in (None, 1.0):
    def loss(x, w_in, w_out):
      y, _ = expert_parallel_moe_mlp(x, ids, cw, w_in, w_out, mesh=mesh, capacity_factor=cf)
      return jnp.sum(y.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    found = dot_precisions(grad, x, w_in, w_out)
    assert found and all(is_highest(p) for _, p, _ in found), (cf, found)
    half = [a.astype(jnp.bfloat16) for a in (x, w_in, w_out)]
    found = dot_precisions(grad, *half)
    assert found and not any(is_highest(p) for _, p, _ in found), (cf, found)
