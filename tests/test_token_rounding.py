"""Token rounding (sparsejax.token_rounding) against a loop over experts, and inside moe_mlp."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax as sj
from moe_testing import IMPLS, assert_close, rand, seed_of
from sparsejax.permute import dropless_placement


def np_round_to_blocks(probs, ids, weights, b):
  """The docstring's rule, one expert at a time: (ids, weights) of k + 1 columns."""
  probs, ids, weights = (np.asarray(a, np.float64 if a.dtype.kind == "f" else a.dtype) for a in (probs, ids, weights))
  T, E = probs.shape
  k = ids.shape[1]
  valid = (ids >= 0) & (ids < E)
  out_ids = np.full((T, k + 1), -1, np.int64)
  out_w = np.zeros((T, k + 1))
  out_ids[:, :k] = np.where(valid, ids, -1)
  out_w[:, :k] = np.where(valid, weights, 0.0)
  nxt, scale = np.full(T, -1), np.ones(T)
  for t in range(T):
    mine = set(ids[t][valid[t]].tolist())
    free = [e for e in range(E) if e not in mine]
    if free:
      nxt[t] = max(free, key=lambda e: (probs[t, e], -e))
    p_sum = sum(probs[t, e] for e in ids[t][valid[t]])
    if p_sum > 0:
      scale[t] = weights[t][valid[t]].sum() / p_sum
  for e in range(E):
    mine = [(t, j) for t in range(T) for j in range(k) if valid[t, j] and ids[t, j] == e]
    c, r = len(mine), len(mine) % b
    if c < b or r == 0:
      continue
    pool = [t for t in range(T) if nxt[t] == e]
    if 2 * r >= b and len(pool) >= b - r:
      for t in sorted(pool, key=lambda t: (-probs[t, e], t))[:b - r]:
        out_ids[t, k], out_w[t, k] = e, probs[t, e] * scale[t]
    else:
      for t, j in sorted(mine, key=lambda tj: (probs[tj[0], e], -(tj[0] * k + tj[1])))[:r]:
        out_ids[t, j], out_w[t, j] = -1, 0.0
  return out_ids, out_w


# Routing and rounding jitted, one compile a shape: op by op, each of their many small ops compiled on its own.
_top_k = jax.jit(sj.top_k_routing, static_argnums=1)
_round = jax.jit(sj.round_to_blocks, static_argnames=("block_size", "impl"))


def _routing(T, E, k, seed, scale=2.0):
  logits = jnp.asarray(rand(np.random.default_rng(seed), (T, E), scale))
  return _top_k(logits, k)


def _counts(ids, E):
  ids = np.asarray(ids)
  return np.bincount(ids[(ids >= 0) & (ids < E)], minlength=E)


# The moves by one sort in XLA ops, and by the Pallas Triton kernel (interpret mode off the GPU).
MOVES = ("xla", "triton")


def _check(r, b, impl="xla"):
  out = jax.jit(sj.round_to_blocks, static_argnames=("block_size", "impl"))(r, b, impl=impl)
  want_ids, want_w = np_round_to_blocks(r.router_probs, r.expert_ids, r.combine_weights, b)
  np.testing.assert_array_equal(out.expert_ids, want_ids)
  np.testing.assert_allclose(out.combine_weights, want_w, rtol=1e-6, atol=1e-7)
  assert out.expert_ids.dtype == jnp.int32 and out.combine_weights.dtype == r.combine_weights.dtype
  np.testing.assert_array_equal(out.router_probs, r.router_probs)
  return out


@pytest.mark.parametrize("impl", MOVES)
@pytest.mark.parametrize("T,E,k,b", [(1000, 8, 1, 32), (1000, 8, 2, 32), (700, 16, 2, 16), (2049, 8, 1, 128),
                                     (300, 4, 3, 8)])
def test_rounding_matches_the_loop_and_leaves_whole_blocks(T, E, k, b, impl):
  r = _routing(T, E, k, seed_of("round", T, E, k, b))
  out = _check(r, b, impl)
  before, after = _counts(r.expert_ids, E), _counts(out.expert_ids, E)
  assert np.all((after % b == 0) | (before < b)), (before, after)
  assert np.all(np.abs(after - before) <= b // 2)
  ids = np.asarray(out.expert_ids)
  assert all(len(set(row[row >= 0].tolist())) == np.sum(row >= 0) for row in ids), "ids must stay distinct"
  moved = np.sum(np.asarray(ids[:, :k]) < 0) + np.sum(ids[:, k] >= 0)
  assert moved > 0  # these routings are not already whole blocks


@pytest.mark.parametrize("impl", MOVES)
def test_both_directions_happen(impl):
  """Counts just past a block drop their tail; counts just short of one take the next choice's best."""
  T, E, b = 512, 4, 64
  probs = np.full((T, E), 0.1)
  owner = np.repeat(np.arange(E), [130, 120, 130, 132])  # r = 2, 56, 2, 4
  probs[np.arange(T), owner] = 0.7
  probs[:, 1] += np.linspace(0, 0.05, T)  # expert 1's candidates ranked by p[t, 1]
  probs /= probs.sum(1, keepdims=True)
  p = jnp.asarray(probs, jnp.float32)
  r = sj.TokenChoiceRouting(jnp.asarray(owner[:, None], jnp.int32), p[np.arange(T), owner][:, None], p, jnp.log(p))
  out = _check(r, b, impl)
  np.testing.assert_array_equal(_counts(out.expert_ids, E), [128, 128, 128, 128])


@pytest.mark.parametrize("case", ["one_expert", "k_equals_E", "all_on_one", "few_tokens", "no_expert_slots",
                                  "already_whole"])
@pytest.mark.parametrize("impl", MOVES)
def test_edge_cases(case, impl):
  rng = np.random.default_rng(seed_of("round_edge", case))
  b = 16
  if case == "one_expert":  # no next choice exists: round down only
    r = _routing(40, 1, 1, 1)
  elif case == "k_equals_E":
    r = _routing(37, 3, 3, 2)
  elif case == "all_on_one":
    logits = rand(rng, (75, 6), 1.0)
    logits[:, 2] += 20.0
    r = _top_k(jnp.asarray(logits), 1)
  elif case == "few_tokens":  # every expert under a block: nothing moves
    r = _routing(20, 4, 2, 3)
  elif case == "no_expert_slots":  # the DTS gate's NO_EXPERT slots are not assignments
    r = _routing(300, 4, 2, 4)
    r = r.replace(expert_ids=r.expert_ids.at[::3, 1].set(sj.NO_EXPERT))
  else:
    r = _routing(64, 4, 1, 5)
    r = r.replace(expert_ids=jnp.repeat(jnp.arange(4, dtype=jnp.int32), 16)[:, None])
  out = _check(r, b, impl)
  before, after = _counts(r.expert_ids, r.router_probs.shape[1]), _counts(out.expert_ids, r.router_probs.shape[1])
  assert np.all((after % b == 0) | (before < b))
  if case in ("few_tokens", "already_whole"):
    np.testing.assert_array_equal(out.expert_ids[:, :-1], r.expert_ids)
    assert np.all(np.asarray(out.expert_ids[:, -1]) == sj.NO_EXPERT)
  if case in ("one_expert", "k_equals_E"):
    assert np.all(np.asarray(out.expert_ids[:, -1]) == sj.NO_EXPERT)


@pytest.mark.parametrize("chunk", [16384, 128])
@pytest.mark.parametrize("T,E,k,b", [(1000, 8, 2, 32), (333, 5, 1, 16)])
def test_rounding_kernel_breaks_ties_as_the_sort(T, E, k, b, chunk):
  """The kernel's moves equal the sort's where scores tie (probabilities of four values), on a row read whole and in
  chunks, T not a power of two."""
  from sparsejax.kernels import block_rounding
  from sparsejax.kernels.block_rounding import triton
  rng = np.random.default_rng(seed_of("round_ties", T, E, k))
  probs = jnp.asarray(rng.choice([0.0, 0.125, 0.25, 0.5], size=(T, E)), jnp.float32)
  expert = jnp.asarray(np.argsort(-rng.random((T, E)), axis=1)[:, :k], jnp.int32).at[::7, 0].set(E)  # some none
  nxt = jnp.asarray(rng.integers(0, E + 1, T), jnp.int32)
  nxt = jnp.where(jnp.any(expert == nxt[:, None], axis=1), E, nxt)
  want = jax.jit(lambda *a: block_rounding.block_moves_reference(*a, b))(probs, expert, nxt)
  got = jax.jit(lambda *a: triton.block_moves(*a, b, triton.Config(chunk=chunk),
                                              interpret=jax.default_backend() != "gpu"))(probs, expert, nxt)
  for g, w, name in zip(got, want, ("keep", "add")):
    np.testing.assert_array_equal(g, w, err_msg=name)
  assert not np.all(np.asarray(want[0])[np.asarray(expert) < E]) and np.any(want[1])  # both directions moved


@pytest.mark.parametrize("chunk", [16384, 128])
@pytest.mark.parametrize("devices,T,E,k,b", [(3, 333, 5, 1, 24), (4, 250, 8, 2, 32)])
def test_group_kernels_break_ties_as_the_sorts(devices, T, E, k, b, chunk):
  """Under an axis (here vmap's), the kernels' moves equal the sorts' where scores tie: devices not a power of two,
  a block that is not one either, each device's rows read whole and in chunks."""
  from sparsejax.kernels import block_rounding
  from sparsejax.kernels.block_rounding import triton
  rng = np.random.default_rng(seed_of("group_ties", devices, T, E, k))
  probs = jnp.asarray(rng.choice([0.0, 0.125, 0.25, 0.5], size=(devices, T, E)), jnp.float32)
  expert = jnp.asarray(np.argsort(-rng.random((devices, T, E)), axis=2)[..., :k], jnp.int32).at[:, ::7, 0].set(E)
  nxt = jnp.asarray(rng.integers(0, E + 1, (devices, T)), jnp.int32)
  nxt = jnp.where(jnp.any(expert == nxt[..., None], axis=2), E, nxt)
  want = jax.jit(jax.vmap(lambda *a: block_rounding.group_moves_reference(*a, b, "g"), axis_name="g"))(
      probs, expert, nxt)
  got = jax.jit(jax.vmap(lambda *a: triton.group_moves(*a, b, "g", triton.Config(chunk=chunk),
                                                       interpret=jax.default_backend() != "gpu"), axis_name="g"))(
      probs, expert, nxt)
  for g, w, name in zip(got, want, ("keep", "add")):
    np.testing.assert_array_equal(g, w, err_msg=name)
  assert not np.all(np.asarray(want[0])[np.asarray(expert) < E]) and np.any(want[1])  # both directions moved


def test_gradients_flow_through_kept_and_added_weights():
  """d/d(probs, weights) of sum(c * rounded weights) is the loop's masks applied to the formula."""
  T, E, k, b = 600, 8, 2, 32
  r = _routing(T, E, k, 7)
  c = jnp.asarray(rand(np.random.default_rng(8), (T, k + 1), 1.0))
  want_ids, _ = np_round_to_blocks(r.router_probs, r.expert_ids, r.combine_weights, b)
  keep, add = want_ids[:, :k] >= 0, want_ids[:, k] >= 0
  nxt = np.maximum(want_ids[:, k], 0)

  def formula(probs, weights):
    picked = jnp.take_along_axis(probs, r.expert_ids, axis=1)
    scale = jnp.sum(weights, 1) / jnp.sum(picked, 1)
    added = jnp.where(add, probs[jnp.arange(T), nxt] * scale, 0.0)
    return jnp.sum(c[:, :k] * jnp.where(keep, weights, 0.0)) + jnp.sum(c[:, k] * added)

  def rounded(probs, weights):
    out = sj.round_to_blocks(r.replace(router_probs=probs, combine_weights=weights), b)
    return jnp.sum(c * out.combine_weights)

  got = jax.jit(jax.grad(rounded, argnums=(0, 1)))(r.router_probs, r.combine_weights)
  want = jax.jit(jax.grad(formula, argnums=(0, 1)))(r.router_probs, r.combine_weights)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
  assert np.any(np.asarray(got[0]) != 0) and np.any(np.asarray(got[1]) != 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_moe_mlp_on_rounded_routing_has_no_padding_rows(dtype):
  """With b = the kernels' block, the padded layout is all real rows, and the layer is the reference's."""
  T, d, f, E, k = 1100, 16, 32, 4, 1
  rng = np.random.default_rng(seed_of("round_mlp", str(dtype)))
  x = jnp.asarray(rand(rng, (T, d)), dtype)
  w_in = jnp.asarray(rand(rng, (E, d, f), d ** -0.5), dtype)
  w_out = jnp.asarray(rand(rng, (E, f, d), f ** -0.5), dtype)
  r = _round(_routing(T, E, k, 9, scale=0.5))
  counts = _counts(r.expert_ids, E)
  assert np.all(counts % 128 == 0) and counts.sum() != T
  placement = dropless_placement(r.expert_ids, E, block_size=128)
  np.testing.assert_array_equal(placement.group_sizes, placement.tokens_per_expert)
  y, stats = jax.jit(sj.moe_mlp)(x, r.expert_ids, r.combine_weights, w_in, w_out)
  want = jax.jit(sj.moe_mlp_reference)(x, r.expert_ids, r.combine_weights, w_in, w_out)
  assert y.dtype == dtype
  assert_close(y, want, 1e-5 if dtype == jnp.float32 else 1e-2, "y")
  np.testing.assert_array_equal(stats.tokens_per_expert, counts)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k", [1, 2])
def test_rounded_moe_mlp_is_moe_mlp_on_the_rounded_columns_in_a_smaller_buffer(k, impl):
  """Values and gradients (x, router logits, both weights) equal moe_mlp's on round_to_blocks' k + 1 columns."""
  from sparsejax import token_rounding as tr
  T, d, f, E = 1100, 16, 24, 4
  rng = np.random.default_rng(seed_of("rounded_mlp", k, impl))
  x = jnp.asarray(rand(rng, (T, d)), jnp.float32)
  w_in = jnp.asarray(rand(rng, (E, d, f), d ** -0.5), jnp.float32)
  w_out = jnp.asarray(rand(rng, (E, f, d), f ** -0.5), jnp.float32)
  # Biased so that, at k = 1 and 2, some experts round up and some down.
  logits = jnp.asarray(rand(np.random.default_rng(3), (T, E), 0.5)) + jnp.asarray([0.0, 0.35, -0.3, 0.1])
  ct = jnp.asarray(rand(rng, (T, d)), jnp.float32)

  def columns(x, logits, w_in, w_out):
    r = sj.round_to_blocks(sj.top_k_routing(logits, k))
    return sj.moe_mlp(x, r.expert_ids, r.combine_weights, w_in, w_out, impl=impl)[0]

  def rounded(x, logits, w_in, w_out):
    return tr.rounded_moe_mlp(x, sj.top_k_routing(logits, k), w_in, w_out, impl=impl)[0]

  r = _top_k(logits, k)
  rr = _round(r)
  ids = np.asarray(rr.expert_ids)
  assert np.sum(ids[:, k] >= 0) > 0 and np.sum(ids[:, :k] < 0) > 0
  _, stats = jax.jit(functools.partial(tr.rounded_moe_mlp, impl=impl))(x, r, w_in, w_out)
  np.testing.assert_array_equal(stats.tokens_per_expert, _counts(ids, E))
  assert int(stats.num_dropped) == np.sum(ids[:, :k] < 0)
  np.testing.assert_allclose(stats.dropped_fraction, int(stats.num_dropped) / (T * k), rtol=1e-6)
  place = jax.jit(dropless_placement, static_argnums=1, static_argnames=("block_size", "num_assignments"))
  small = place(rr.expert_ids, E, block_size=128, num_assignments=T * k + tr.max_added(E))
  assert small.num_rows < place(rr.expert_ids, E, block_size=128).num_rows
  rows = np.asarray(small.rows)
  assert np.max(np.where(rows < small.num_rows, rows, -1)) < small.num_rows
  # Jitted: op by op, each of the many small ops (and interpreted kernels) compiles on its own.
  assert_close(jax.jit(rounded)(x, logits, w_in, w_out), jax.jit(columns)(x, logits, w_in, w_out), 1e-5, "y")
  loss = lambda fn: lambda *a: jnp.sum(fn(*a) * ct)
  got = jax.jit(jax.grad(loss(rounded), argnums=(0, 1, 2, 3)))(x, logits, w_in, w_out)
  want = jax.jit(jax.grad(loss(columns), argnums=(0, 1, 2, 3)))(x, logits, w_in, w_out)
  for g, w, what in zip(got, want, ("x", "logits", "w_in", "w_out")):
    assert_close(g, w, 1e-5, what)


@pytest.mark.parametrize("block_size,msg", [(0, "block_size must be a positive int"),
                                            (True, "block_size must be a positive int"),
                                            (2.0, "block_size must be a positive int")])
def test_bad_block_size_is_one_line(block_size, msg):
  with pytest.raises(ValueError, match=msg) as e:
    sj.round_to_blocks(_routing(10, 4, 1, 0), block_size)
  assert "\n" not in str(e.value)


def test_bad_impl_is_one_line():
  with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'triton', 'xla'\); got 'cuda'") as e:
    sj.round_to_blocks(_routing(10, 4, 1, 0), 4, impl="cuda")
  assert "\n" not in str(e.value)


def test_mismatched_routing_is_one_line():
  r = _routing(10, 4, 2, 0)
  with pytest.raises(ValueError, match="must agree") as e:
    sj.round_to_blocks(r.replace(combine_weights=r.combine_weights[:, :1]))
  assert "\n" not in str(e.value)
  x, w = jnp.zeros((10, 8)), jnp.ones((3, 8, 8))  # three experts' weights for a routing over four
  with pytest.raises(ValueError, match=r"router_probs must be \[tokens, experts\] = \(10, 3\)") as e:
    sj.rounded_moe_mlp(x, _routing(10, 4, 1, 0), w, w)
  assert "\n" not in str(e.value)


def test_moe_module_rounds_only_calls_with_an_rng():
  """MoEConfig.token_rounding: training calls (an rng) are rounded_moe_mlp; evaluation calls plain top-k."""
  from flax import nnx

  from sparsejax import token_rounding as tr
  cfg = sj.MoEConfig(d_model=16, d_ff=24, num_experts=4, token_rounding=True)
  moe = sj.MoE(cfg, rngs=nnx.Rngs(0))
  plain = sj.MoE(dataclasses.replace(cfg, token_rounding=False), rngs=nnx.Rngs(0))
  x = jnp.asarray(rand(np.random.default_rng(11), (1100, 16)), jnp.float32)
  r = _top_k(moe.router(x), 1)
  want, want_stats = jax.jit(tr.rounded_moe_mlp)(x, r, moe.w_in[...], moe.w_out[...])
  call = nnx.jit(lambda m, x, rng: m(x, rng=rng))  # jitted: op by op, each small op compiles on its own
  y, stats = call(moe, x, jax.random.key(0))
  assert_close(y, want, 1e-5, "y")
  np.testing.assert_array_equal(stats.tokens_per_expert, want_stats.tokens_per_expert)
  assert np.all(np.asarray(stats.tokens_per_expert) % 128 == 0) and int(stats.num_dropped) > 0
  assert_close(call(moe, x, None)[0], call(plain, x, None)[0], 1e-5, "y without an rng")  # evaluation: plain top-k
  _, plain_stats = call(plain, x, jax.random.key(0))  # a training call without rounding stays dropless
  np.testing.assert_array_equal(plain_stats.tokens_per_expert, _counts(r.expert_ids, 4))


@pytest.mark.parametrize("bad,msg", [(dict(token_rounding=1), "token_rounding must be True or False"),
                                     (dict(token_rounding=True, capacity_factor=1.25), "needs router='top_k'"),
                                     (dict(token_rounding=True, router="dense_to_sparse"), "needs router='top_k'")])
def test_token_rounding_config_errors_are_one_line(bad, msg):
  with pytest.raises(ValueError, match=msg) as e:
    sj.MoEConfig(d_model=16, d_ff=24, **bad)
  assert "\n" not in str(e.value)


def test_rounded_moe_mlp_with_gated_experts():
  """SwiGLU experts (w_gate, silu) through rounded_moe_mlp equal moe_mlp on the rounded columns."""
  T, d, f, E = 700, 16, 24, 4
  rng = np.random.default_rng(seed_of("rounded_glu"))
  x = jnp.asarray(rand(rng, (T, d)), jnp.float32)
  w_in, w_gate = (jnp.asarray(rand(rng, (E, d, f), d ** -0.5), jnp.float32) for _ in range(2))
  w_out = jnp.asarray(rand(rng, (E, f, d), f ** -0.5), jnp.float32)
  r = _top_k(jnp.asarray(rand(rng, (T, E), 0.5)) + jnp.asarray([0.0, 0.35, -0.3, 0.1]), 2)
  rr = _round(r)
  got = jax.jit(lambda x, w_in, w_out, w_gate: sj.rounded_moe_mlp(x, r, w_in, w_out, w_gate=w_gate,
                                                                  activation=jax.nn.silu)[0])(x, w_in, w_out, w_gate)
  want = jax.jit(lambda x, w_in, w_out, w_gate: sj.moe_mlp(
      x, rr.expert_ids, rr.combine_weights, w_in, w_out, w_gate=w_gate, activation=jax.nn.silu)[0])(
          x, w_in, w_out, w_gate)
  assert_close(got, want, 1e-5, "y")
  assert not np.allclose(np.asarray(rr.expert_ids[:, :2]), np.asarray(r.expert_ids))  # rounding moved something


# ------------------------------------------------------------------------------------------------
# Under expert parallelism: each exchange group's tokens rounded as one batch (eight host devices).


def _mesh(shape, names):
  return jax.sharding.Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


@functools.lru_cache(maxsize=None)
def _rounding_over(b, mesh, axis, impl):
  """jit(round_to_blocks(axis_name=axis) inside shard_map), tokens sharded over all of mesh's axes; cached, so
  routings of one shape share a compile."""
  from sparsejax.parallel import _shard_map
  tok = jax.sharding.PartitionSpec(mesh.axis_names)

  def local(ids, cw, probs):
    out = sj.round_to_blocks(sj.TokenChoiceRouting(ids, cw, probs, probs), b, axis_name=axis, impl=impl)
    return out.expert_ids, out.combine_weights
  return jax.jit(_shard_map(local, mesh, (tok, tok, tok), (tok, tok), check=impl == "xla"))


@pytest.mark.devices(8)
@pytest.mark.parametrize("impl", MOVES)
@pytest.mark.parametrize("layout", ["expert_axis", "data_and_expert", "two_expert_axes", "k_equals_E"])
def test_rounding_over_an_axis_is_rounding_each_groups_tokens(layout, impl):
  """round_to_blocks(axis_name) on each device equals round_to_blocks on its group's concatenated tokens:
  ids exactly, weights to float32 rounding, whichever device holds the moved assignments. On one expert axis,
  routings with many ties, all tokens on one expert and NO_EXPERT slots too."""
  T, E, k, b = 1000, 8, 1, 32
  shape, names, axis = (8,), ("expert",), "expert"
  if layout == "data_and_expert":  # two groups of four devices: each rounds alone
    shape, names, k = (2, 4), ("data", "expert"), 2
  elif layout == "two_expert_axes":  # the hierarchical exchange's (group, device) axes, as one group
    shape, names, axis, k, b = (2, 4), ("expert_group", "expert"), ("expert_group", "expert"), 2, 64
  elif layout == "k_equals_E":
    E, k, b = 3, 3, 16
  rng = np.random.default_rng(seed_of("round_axis", layout))
  cases = {"random": rand(rng, (T, E), 2.0)}
  if layout == "expert_axis":
    cases["ties"] = rng.integers(0, 3, (T, E)).astype(np.float32)  # the order across devices: the concatenation's
    cases["all_on_one"] = cases["random"] + 20.0 * (np.arange(E) == 3)
    cases["no_expert_slots"] = cases["random"]
  run = _rounding_over(b, _mesh(shape, names), axis, impl)
  groups = shape[0] if names[0] == "data" else 1
  for case, logits in cases.items():
    r = _top_k(jnp.asarray(logits, jnp.float32), k)
    if case == "no_expert_slots":
      r = r.replace(expert_ids=r.expert_ids.at[::3].set(sj.NO_EXPERT))
    ids, w = run(r.expert_ids, r.combine_weights, r.router_probs)
    want = [_round(jax.tree.map(lambda a: a[part], r), b) for part in np.split(np.arange(T), groups)]
    np.testing.assert_array_equal(ids, np.concatenate([o.expert_ids for o in want]), err_msg=case)
    np.testing.assert_allclose(w, np.concatenate([o.combine_weights for o in want]), rtol=1e-6, atol=1e-7,
                               err_msg=case)
    moved = np.sum(np.asarray(ids)[:, :k] < 0) + np.sum(np.asarray(ids)[:, k] >= 0) - np.sum(
        np.asarray(r.expert_ids) < 0)
    assert moved > 0 or layout == "k_equals_E", case


def _ep_problem(T=2048, E=8, k=1, seed=0):
  rng = np.random.default_rng(seed_of("rounded_ep", T, E, k, seed))
  x = jnp.asarray(rand(rng, (T, 8)))
  w_in = jnp.asarray(rand(rng, (E, 8, 16), 8 ** -0.5))
  w_out = jnp.asarray(rand(rng, (E, 16, 8), 16 ** -0.5))
  logits = jnp.asarray(rand(rng, (T, E), 0.5)) + jnp.linspace(-0.3, 0.3, E)  # some round up, some down
  return x, logits, w_in, w_out, jnp.asarray(rand(rng, (T, 8)))


def _per_group(x, logits, w_in, w_out, k, groups, impl="auto"):
  """The single-device rounded layer on each group's tokens: groups is a list of token index arrays."""
  r = _top_k(logits, k)
  layer = jax.jit(functools.partial(sj.rounded_moe_mlp, impl=impl))
  out = [layer(x[g], jax.tree.map(lambda a: a[g], r), w_in, w_out) for g in groups]
  y = jnp.zeros_like(x)
  for g, (yg, _) in zip(groups, out):
    y = y.at[g].set(yg)
  return y, [s for _, s in out]


@pytest.mark.devices(8)
@pytest.mark.parametrize("shape,k,dispatch,buffer_factor", [
    ((1, 8), 1, "assignments", None), ((2, 4), 2, "assignments", None), ((2, 4), 2, "tokens", None),
    ((2, 4), 2, "tokens", 1.0), ((2, 4), 2, "tokens", 3.0)])
def test_expert_parallel_rounded_layer_is_the_rounded_layer_on_each_group(shape, k, dispatch, buffer_factor):
  """Values, four gradients and the statistics equal rounded_moe_mlp run on each data slice's tokens
  (the exchange sending a row an assignment, or a row a token and peer; with a receiver bound of f times the
  mean: at f = 1 the rounded routing passes it and takes the fallback, at 3 it fits, below the worst case)."""
  from sparsejax import mesh as meshlib
  from sparsejax.parallel import ExpertParallelConfig
  x, logits, w_in, w_out, ct = _ep_problem(k=k)
  mesh = meshlib.make_expert_mesh(*shape)
  groups = np.split(np.arange(x.shape[0]), shape[0])

  def sharded(x, logits, w_in, w_out):
    return sj.rounded_moe_mlp(x, sj.top_k_routing(logits, k), w_in, w_out, mesh=mesh,
                              parallel=ExpertParallelConfig(dispatch=dispatch, buffer_factor=buffer_factor))

  def single(x, logits, w_in, w_out):
    return _per_group(x, logits, w_in, w_out, k, groups)

  (y, stats), (y0, stats0) = jax.jit(sharded)(x, logits, w_in, w_out), jax.jit(single)(x, logits, w_in, w_out)
  assert_close(y, y0, 1e-5, "y")
  np.testing.assert_array_equal(stats.tokens_per_expert, sum(s.tokens_per_expert for s in stats0))
  assert int(stats.num_dropped) == sum(int(s.num_dropped) for s in stats0) > 0
  assert (int(stats.exchange_overflow) > 0) == (buffer_factor == 1.0)
  np.testing.assert_allclose(stats.dropped_fraction, int(stats.num_dropped) / (x.shape[0] * k), rtol=1e-6)
  loss = lambda fn: lambda *a: jnp.sum(fn(*a)[0] * ct)
  got = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2, 3)))(x, logits, w_in, w_out)
  want = jax.jit(jax.grad(loss(single), argnums=(0, 1, 2, 3)))(x, logits, w_in, w_out)
  for g, w, what in zip(got, want, ("x", "logits", "w_in", "w_out")):
    assert_close(g, w, 1e-5, what)


@pytest.mark.devices(8)
def test_expert_parallel_rounding_by_token_chunks_and_through_the_pallas_kernels():
  """token_chunks=2: chunk c of every device is one group. The Pallas path (interpreted) gets whole blocks."""
  from sparsejax import mesh as meshlib
  from sparsejax.parallel import ExpertParallelConfig
  x, logits, w_in, w_out, _ = _ep_problem(T=2048, E=4, seed=1)
  mesh = meshlib.make_expert_mesh(1, 8)
  local, half = x.shape[0] // 8, x.shape[0] // 16
  groups = [np.concatenate([np.arange(q * local + c * half, q * local + (c + 1) * half) for q in range(8)])
            for c in range(2)]
  y0, stats0 = _per_group(x, logits, w_in, w_out, 1, groups)
  for impl in ("auto", "pallas"):
    y, stats = jax.jit(lambda x, logits, w_in, w_out: sj.rounded_moe_mlp(
        x, sj.top_k_routing(logits, 1), w_in, w_out, mesh=mesh, impl=impl,
        parallel=ExpertParallelConfig(token_chunks=2)))(x, logits, w_in, w_out)
    assert_close(y, y0, 1e-5, f"y ({impl})")
    np.testing.assert_array_equal(stats.tokens_per_expert, sum(s.tokens_per_expert for s in stats0))
    for s in stats0:  # whole blocks in each group (an expert under one block is left alone)
      c = np.asarray(s.tokens_per_expert)
      assert np.all((c % 128 == 0) | (c < 128)) and np.any(c >= 128), c


@pytest.mark.devices(8)
def test_moe_module_rounds_under_expert_parallelism():
  """MoEConfig.token_rounding with a mesh of one data slice: the single-device module's rounded layer."""
  from flax import nnx

  from sparsejax import mesh as meshlib
  cfg = sj.MoEConfig(d_model=16, d_ff=24, num_experts=8, token_rounding=True)
  mesh = meshlib.make_expert_mesh(1, 8)
  single, sharded = sj.MoE(cfg, rngs=nnx.Rngs(0)), sj.MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh)
  x = jnp.asarray(rand(np.random.default_rng(12), (2048, 16)), jnp.float32)
  with_rng, without = nnx.jit(lambda m, x: m(x, rng=jax.random.key(0))), nnx.jit(lambda m, x: m(x))
  (y0, s0), (y1, s1) = with_rng(single, x), with_rng(sharded, x)
  assert_close(y1, y0, 1e-5, "y")
  np.testing.assert_array_equal(s1.tokens_per_expert, s0.tokens_per_expert)
  assert int(s1.num_dropped) == int(s0.num_dropped) > 0
  assert_close(without(sharded, x)[0], without(single, x)[0], 1e-5, "y without an rng")


def test_rounded_moe_mlp_parallel_needs_a_mesh():
  from sparsejax.parallel import ExpertParallelConfig
  x, w = jnp.zeros((10, 8)), jnp.ones((4, 8, 8))
  with pytest.raises(ValueError, match="parallel .* needs a mesh") as e:
    sj.rounded_moe_mlp(x, _routing(10, 4, 1, 0), w, w, parallel=ExpertParallelConfig())
  assert "\n" not in str(e.value)


@pytest.mark.devices(8)
def test_an_axis_name_outside_the_shard_map_is_one_line():
  r = _routing(64, 4, 1, 0)
  with pytest.raises(ValueError, match="axis_name 'nope' is not an axis of the enclosing shard_map") as e:
    _rounding_over(16, _mesh((8,), ("expert",)), "nope", "xla")(r.expert_ids, r.combine_weights, r.router_probs)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="axis_name 'expert' is not an axis"):
    sj.round_to_blocks(r, 16, axis_name="expert")  # not inside any
