"""moe_mlp against the dense masked reference, and the reference against a float64 per-token loop.

Forward values and gradients w.r.t. x, w_in, w_out, w_gate and the router logits (routed inside
the differentiated function, so the logits' gradient flows through the combine weights).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax as sj
from moe_testing import (ACTIVATIONS, IMPLS, assert_close, bf16_round, dot_precisions, is_highest,
                         np_capacity_keep, np_moe_loop, np_top_k_routing, rand, seed_of)


@dataclasses.dataclass(frozen=True)
class Case:
  """One routing situation. route: "random" logits, "skip" (expert 0 never chosen), "one"
  (every token's first choice is expert 0)."""
  name: str
  T: int
  E: int
  k: int
  route: str = "random"
  cf: float | None = None
  glu: bool = False
  d: int = 8
  f: int = 16

  def __str__(self):
    return self.name


# Each edge case appears in dropless and capacity mode, with MLP and GLU experts spread over them
# (the common case, T37_E4_k2, with both).
CASES = [
    # dropless
    Case("T37_E4_k2", 37, 4, 2),
    Case("T37_E4_k2_glu", 37, 4, 2, glu=True),
    Case("T1_E4_k1_glu", 1, 4, 1, glu=True),
    Case("T130_E8_k2_skip", 130, 8, 2, "skip", d=8, f=8),
    Case("T37_E4_k1_one_glu", 37, 4, 1, "one", glu=True),
    Case("T16_E4_k4_kEqE", 16, 4, 4, d=8, f=8),
    Case("T9_E1_k1_glu", 9, 1, 1, glu=True),
    # capacity
    Case("cap_T37_E4_k2_cf1_glu", 37, 4, 2, cf=1.0, glu=True),
    Case("cap_T37_E4_k1_one_cf0.5", 37, 4, 1, "one", cf=0.5),
    Case("cap_T130_E8_k2_skip_cf1.25_glu", 130, 8, 2, "skip", cf=1.25, glu=True, d=8, f=8),
    Case("cap_T16_E4_k4_cf0.5_glu", 16, 4, 4, cf=0.5, glu=True, d=8, f=8),
    Case("cap_T9_E1_k1_cf0.3", 9, 1, 1, cf=0.3),
    Case("cap_T1_E4_k2_cf2", 1, 4, 2, cf=2.0),
]


def make_inputs(case: Case, seed: int):
  rng = np.random.default_rng(seed)
  x = rand(rng, (case.T, case.d))
  logits = rand(rng, (case.T, case.E), 2.0)
  if case.route == "skip" and case.E > 1:
    logits[:, 0] = -30.0
  if case.route == "one":
    logits[:, 0] = 30.0
  w_in = rand(rng, (case.E, case.d, case.f), case.d**-0.5)
  w_out = rand(rng, (case.E, case.f, case.d), case.f**-0.5)
  w_gate = rand(rng, (case.E, case.d, case.f), case.d**-0.5) if case.glu else None
  ct = rand(rng, (case.T, case.d))  # the cotangent: loss = sum(y * ct)
  # dcw (zero) is added to the combine weights, so its gradient is dL/d(combine weights).
  dcw = np.zeros((case.T, case.k), np.float32)
  return dict(x=x, logits=logits, w_in=w_in, w_out=w_out, w_gate=w_gate, dcw=dcw), ct


def cap_of(case: Case):
  return None if case.cf is None else sj.capacity(case.T, case.E, case.k, case.cf)


def impl_loss(case, act, impl, ct):
  def f(p):
    r = sj.top_k_routing(p["logits"], case.k)
    y, stats = sj.moe_mlp(p["x"], r.expert_ids, r.combine_weights + p["dcw"], p["w_in"], p["w_out"],
                          w_gate=p["w_gate"], activation=act, capacity_factor=case.cf, impl=impl)
    return jnp.sum(y.astype(jnp.float32) * ct), (y, stats, r.expert_ids)
  return f


def ref_loss(case, act, ct):
  def f(p):
    r = sj.top_k_routing(p["logits"], case.k)
    y = sj.moe_mlp_reference(p["x"], r.expert_ids, r.combine_weights + p.get("dcw", 0.0), p["w_in"], p["w_out"],
                             w_gate=p["w_gate"], activation=act, capacity=cap_of(case))
    return jnp.sum(y * ct), y
  return f


def value_and_grads(loss, params):
  (_, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return aux, grads


@functools.lru_cache(maxsize=None)
def reference_results(case: Case, dtype: str):
  """Inputs (bf16-rounded for bf16) and the f32 reference's output and gradients; shared by impls."""
  act = ACTIVATIONS["silu" if case.glu else "gelu"][0]
  params, ct = make_inputs(case, seed_of(case.name, dtype))
  if dtype == "bfloat16":
    # Expert-side inputs in bf16; the reference sees the same rounded values in f32. Logits stay f32.
    for n in ("x", "w_in", "w_out", "w_gate"):
      if params[n] is not None:
        params[n] = bf16_round(params[n])
  ref_params = {n: None if v is None else jnp.asarray(v) for n, v in params.items()}
  y_ref, grads_ref = value_and_grads(ref_loss(case, act, jnp.asarray(ct)), ref_params)
  return params, ct, y_ref, grads_ref


@functools.lru_cache(maxsize=None)
def routing_weights(case: Case):
  """The library's combine weights for the float32 inputs' logits (the float64 loop's weights): one
  jitted routing per case, shared by its impls."""
  logits = jnp.asarray(reference_results(case, "float32")[0]["logits"])
  return np.asarray(jax.jit(sj.top_k_routing, static_argnums=1)(logits, case.k).combine_weights)


# Dropless cases run every grouped-matmul backend. Capacity mode computes its equal-size expert
# groups with one batched einsum whatever impl says, so it runs once, under "auto".
GRID = [(c, impl) for c in CASES for impl in (IMPLS if c.cf is None else ["auto"])]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case,impl", GRID, ids=[f"{c}-{i}" for c, i in GRID])
def test_moe_mlp_matches_reference(case, dtype, impl):
  act_name = "silu" if case.glu else "gelu"
  act = ACTIVATIONS[act_name][0]
  params, ct, y_ref, grads_ref = reference_results(case, dtype)
  ct = jnp.asarray(ct)
  # bf16 runs see the bf16 casts of the (already bf16-rounded) expert inputs; router side stays f32.
  low = ("x", "w_in", "w_out", "w_gate") if dtype == "bfloat16" else ()
  test_params = {n: None if v is None else jnp.asarray(v, jnp.bfloat16 if n in low else jnp.float32)
                 for n, v in params.items()}
  rtol = 1e-5 if dtype == "float32" else 1e-2
  # A gradient sums bf16-rounded products over d or T (dL/dcw[t] = <FFN(x_t), ct_t>), so it
  # carries about twice the relative error of the forward values.
  grad_rtol = 1e-5 if dtype == "float32" else 2e-2

  (y, stats, ids), grads = value_and_grads(impl_loss(case, act, impl, ct), test_params)

  assert y.dtype == jnp.dtype(dtype) and y.shape == (case.T, case.d)
  assert_close(y, y_ref, rtol, "y")
  for n in ("x", "dcw", "logits", "w_in", "w_out", "w_gate"):
    if params[n] is None:
      continue
    assert grads[n].dtype == test_params[n].dtype
    scale = None
    if n == "logits":
      # dL/dlogits = J_softmax^T dL/dcw subtracts nearly equal expert outputs; its error is set by
      # the scale of dL/dcw (|J| <= 1), not by its own, possibly much smaller, values.
      scale = float(np.max(np.abs(np.asarray(grads_ref["dcw"]))))
    assert_close(grads[n], grads_ref[n], grad_rtol, f"d/d{n}", scale=scale)

  # Statistics: exact counts against a numpy count of the same routing.
  ids = np.asarray(ids)
  np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert),
                                np.bincount(ids.reshape(-1), minlength=case.E))
  keep = np_capacity_keep(ids, case.E, cap_of(case))
  assert int(stats.num_dropped) == int((~keep).sum())
  np.testing.assert_allclose(float(stats.dropped_fraction), (~keep).sum() / ids.size, rtol=1e-6)
  if case.route == "skip" and case.E > 1:
    assert int(stats.tokens_per_expert[0]) == 0
  if case.route == "one":
    assert int(stats.tokens_per_expert[0]) == case.T

  if dtype == "float32":
    # And straight against the float64 loop (forward), sharing no code with the library.
    w = routing_weights(case)
    y_loop = np_moe_loop(params["x"], ids, w, params["w_in"], params["w_out"], params["w_gate"],
                         act_name, cap_of(case))
    assert_close(y, y_loop, rtol, "y vs float64 loop")


# ---------------------------------------------------------------- the reference vs the float64 loop
def _loop_loss(case, act_name, params, ct):
  ids, w, _ = np_top_k_routing(params["logits"], case.k)
  y = np_moe_loop(params["x"], ids, w, params["w_in"], params["w_out"], params["w_gate"], act_name,
                  cap_of(case))
  return float(np.sum(y * ct)), y


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_float64_loop(case):
  """Forward values, and gradients by central differences of the float64 loop along random directions."""
  act_name = "silu" if case.glu else "gelu"
  params, ct = make_inputs(case, seed_of("loop", case.name))
  del params["dcw"]
  jparams = {n: None if v is None else jnp.asarray(v) for n, v in params.items()}
  y_ref, grads = value_and_grads(ref_loss(case, ACTIVATIONS[act_name][0], jnp.asarray(ct)), jparams)

  # The loop's routing must be the library's routing (no ties in random logits).
  ids_np, w_np, p_np = np_top_k_routing(params["logits"], case.k)
  r = jax.jit(sj.top_k_routing, static_argnums=1)(jnp.asarray(params["logits"]), case.k)
  np.testing.assert_array_equal(np.asarray(r.expert_ids), ids_np)
  np.testing.assert_allclose(np.asarray(r.combine_weights), w_np, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(r.router_probs), p_np, rtol=1e-5, atol=1e-7)

  _, y_loop = _loop_loss(case, act_name, params, ct)
  assert_close(y_ref, y_loop, 1e-5, "reference vs loop")

  rng = np.random.default_rng(seed_of("dir", case.name))
  eps = 1e-4
  for n in ("x", "logits", "w_in", "w_out", "w_gate"):
    if params[n] is None:
      continue
    v = rng.standard_normal(params[n].shape)
    p64 = {m: None if a is None else np.asarray(a, np.float64) for m, a in params.items()}
    plus, minus = dict(p64), dict(p64)
    plus[n], minus[n] = p64[n] + eps * v, p64[n] - eps * v
    fd = (_loop_loss(case, act_name, plus, ct)[0] - _loop_loss(case, act_name, minus, ct)[0]) / (2 * eps)
    g = np.asarray(grads[n], np.float64)
    scale = np.sum(np.abs(g * v)) + 1e-12
    assert abs(np.sum(g * v) - fd) <= 1e-4 * scale + 1e-9, (n, np.sum(g * v), fd)


# ---------------------------------------------------------------- capacity: drops, exactly
@pytest.mark.parametrize("impl", IMPLS)
def test_capacity_drops_are_exact_zeros_and_counted(impl):
  """All 10 tokens go to expert 0 with C = ceil(0.8 * 10 * 1 / 4) = 2: tokens 2..9 are dropped."""
  T, E, d, f = 10, 4, 8, 16
  rng = np.random.default_rng(seed_of("drops", impl))
  x = jnp.asarray(rand(rng, (T, d)))
  w_in, w_out = jnp.asarray(rand(rng, (E, d, f))), jnp.asarray(rand(rng, (E, f, d)))
  ids = jnp.zeros((T, 1), jnp.int32)
  w = jnp.asarray(rng.uniform(0.5, 1.0, (T, 1)).astype(np.float32))
  assert sj.capacity(T, E, 1, 0.8) == 2

  def f_(x, w):
    return sj.moe_mlp(x, ids, w, w_in, w_out, capacity_factor=0.8, impl=impl)

  (y, stats), vjp = jax.jit(lambda x, w: jax.vjp(f_, x, w))(x, w)
  assert int(stats.num_dropped) == 8
  assert float(stats.dropped_fraction) == pytest.approx(0.8)
  np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), [10, 0, 0, 0])
  assert np.all(np.asarray(y[2:]) == 0.0)
  y_loop = np_moe_loop(x, np.asarray(ids), w, w_in, w_out, capacity=2)
  assert_close(y, y_loop, 1e-5, "kept tokens")
  assert np.all(np.abs(np.asarray(y[:2])) > 0)
  zero_stats = jax.tree.map(jnp.zeros_like, stats)
  dx, dw = vjp((jnp.ones_like(y), zero_stats))
  assert np.all(np.asarray(dx[2:]) == 0.0) and np.all(np.asarray(dw[2:]) == 0.0)
  assert np.all(np.any(np.asarray(dx[:2]) != 0.0, axis=-1))


def test_capacity_counts_with_mixed_slots():
  """k=2, E=3, C=1 by hand: ids [[0,1],[0,2],[1,0]] keep (0,0),(0,1),(1,1); drop (1,0),(2,0),(2,1)."""
  d, f, E = 4, 4, 3
  rng = np.random.default_rng(7)
  x = jnp.asarray(rand(rng, (3, d)))
  w_in, w_out = jnp.asarray(rand(rng, (E, d, f))), jnp.asarray(rand(rng, (E, f, d)))
  ids = jnp.asarray([[0, 1], [0, 2], [1, 0]], jnp.int32)
  w = jnp.full((3, 2), 0.5, jnp.float32)
  cf = 0.5  # C = ceil(0.5 * 3 * 2 / 3) = 1
  assert sj.capacity(3, E, 2, cf) == 1
  y, stats = jax.jit(sj.moe_mlp, static_argnames="capacity_factor")(x, ids, w, w_in, w_out, capacity_factor=cf)
  assert int(stats.num_dropped) == 3
  np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), [3, 2, 1])
  assert np.all(np.asarray(y[2]) == 0.0)
  ffn = lambda t, e: jax.nn.gelu(x[t] @ w_in[e]) @ w_out[e]
  np.testing.assert_allclose(y[0], 0.5 * ffn(0, 0) + 0.5 * ffn(0, 1), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(y[1], 0.5 * ffn(1, 2), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- NO_EXPERT slots
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cf", [None, 0.3])  # C = 3 for 21 real assignments on 4 experts: drops
def test_no_expert_slots_are_ignored(impl, cf):
  T, E, k, d, f = 12, 4, 3, 8, 8
  rng = np.random.default_rng(seed_of("noexp", impl, cf))
  x = jnp.asarray(rand(rng, (T, d)))
  w_in, w_out = jnp.asarray(rand(rng, (E, d, f))), jnp.asarray(rand(rng, (E, f, d)))
  ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
  ids[::2, 1:] = sj.NO_EXPERT
  ids[5, :] = sj.NO_EXPERT  # a token that goes nowhere
  w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
  w_junk = w.copy()
  w_junk[ids == sj.NO_EXPERT] = 123.0  # must not matter
  ids = jnp.asarray(ids)
  c = None if cf is None else sj.capacity(T, E, k, cf)
  y, stats = jax.jit(lambda *a: sj.moe_mlp(*a, capacity_factor=cf, impl=impl))(
      x, ids, jnp.asarray(w_junk), w_in, w_out)
  y_ref = jax.jit(lambda *a: sj.moe_mlp_reference(*a, capacity=c))(x, ids, jnp.asarray(w), w_in, w_out)
  assert_close(y, y_ref, 1e-5, "y")
  assert_close(y, np_moe_loop(x, np.asarray(ids), w, w_in, w_out, capacity=c), 1e-5, "loop")
  assert np.all(np.asarray(y[5]) == 0.0)
  valid = np.asarray(ids)[np.asarray(ids) >= 0]
  np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), np.bincount(valid, minlength=E))
  keep = np_capacity_keep(np.asarray(ids), E, c)
  dropped = int(((np.asarray(ids) >= 0) & ~keep).sum())
  assert int(stats.num_dropped) == dropped
  assert (dropped > 0) == (cf is not None)
  # The fraction is of real assignments: NO_EXPERT slots are not in the denominator.
  np.testing.assert_allclose(float(stats.dropped_fraction), dropped / valid.size, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cf", [None, 0.3])
def test_ids_outside_the_experts_are_no_expert_slots(impl, cf):
  """An id outside [0, E) (E, E + 10, -5; routing's own NO_EXPERT is -1) is a slot with no expert: the same
  output and stats as NO_EXPERT there, on every backend and in the capacity layer (the moe_mlp docstring)."""
  T, E, k, d, f = 12, 4, 2, 8, 8
  rng = np.random.default_rng(seed_of("outside", impl, cf))
  x = jnp.asarray(rand(rng, (T, d)))
  w_in, w_out = jnp.asarray(rand(rng, (E, d, f))), jnp.asarray(rand(rng, (E, f, d)))
  ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
  w = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
  outside = ids.copy()
  outside[0::3, 1], outside[1::3, 1], outside[2::3, 1] = E, E + 10, -5
  none = ids.copy()
  none[:, 1] = sj.NO_EXPERT
  run = jax.jit(lambda i: sj.moe_mlp(x, i, w, w_in, w_out, capacity_factor=cf, impl=impl))
  (y, stats), (y_none, stats_none) = run(jnp.asarray(outside)), run(jnp.asarray(none))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_none))
  np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), np.asarray(stats_none.tokens_per_expert))
  assert int(stats.num_dropped) == int(stats_none.num_dropped)


# ---------------------------------------------------------------- jit, grad, vmap
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cf", [None, 1.0])
def test_vmap_jit_grad_match_unbatched(impl, cf):
  B, T, E, k, d, f = 3, 20, 4, 2, 8, 8
  rng = np.random.default_rng(seed_of("vmap", impl, cf))
  x = jnp.asarray(rand(rng, (B, T, d)))
  logits = jnp.asarray(rand(rng, (B, T, E), 2.0))
  w_in, w_out = jnp.asarray(rand(rng, (E, d, f), 0.3)), jnp.asarray(rand(rng, (E, f, d), 0.3))

  def layer(x, logits, w_in, w_out):
    r = sj.top_k_routing(logits, k)
    y, stats = sj.moe_mlp(x, r.expert_ids, r.combine_weights, w_in, w_out, capacity_factor=cf,
                          impl=impl)
    return y, stats

  def loss(x, logits, w_in, w_out):
    y, stats = jax.vmap(layer, in_axes=(0, 0, None, None))(x, logits, w_in, w_out)
    return jnp.sum(y**2), (y, stats)

  # The layer's outputs ride along as aux: one jitted program gives the values and the gradients,
  # batched (vmap) and unbatched alike.
  grads, (y_b, stats_b) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, logits, w_in, w_out)
  assert y_b.shape == (B, T, d) and stats_b.tokens_per_expert.shape == (B, E)

  g_sum = [jnp.zeros_like(w_in), jnp.zeros_like(w_out)]
  grad1 = jax.jit(jax.grad(lambda *a: (lambda y, stats: (jnp.sum(y ** 2), (y, stats)))(*layer(*a)),
                           argnums=(0, 1, 2, 3), has_aux=True))
  for b in range(B):
    gb, (y, stats) = grad1(x[b], logits[b], w_in, w_out)  # unbatched
    np.testing.assert_allclose(y_b[b], y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(stats_b.tokens_per_expert[b], stats.tokens_per_expert)
    np.testing.assert_array_equal(stats_b.num_dropped[b], stats.num_dropped)
    np.testing.assert_allclose(grads[0][b], gb[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads[1][b], gb[1], rtol=1e-5, atol=1e-6)
    g_sum = [g_sum[0] + gb[2], g_sum[1] + gb[3]]
  np.testing.assert_allclose(grads[2], g_sum[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grads[3], g_sum[1], rtol=1e-5, atol=1e-5)


def test_auto_impl_matches_reference_impl():
  rng = np.random.default_rng(11)
  x = jnp.asarray(rand(rng, (21, 8)))
  r = jax.jit(sj.top_k_routing, static_argnums=1)(jnp.asarray(rand(rng, (21, 4))), 2)
  w_in, w_out = jnp.asarray(rand(rng, (4, 8, 8))), jnp.asarray(rand(rng, (4, 8, 8)))
  run = jax.jit(sj.moe_mlp, static_argnames="impl")
  y_auto, _ = run(x, r.expert_ids, r.combine_weights, w_in, w_out)
  y_ref, _ = run(x, r.expert_ids, r.combine_weights, w_in, w_out, impl="reference")
  assert_close(y_auto, y_ref, 1e-5, "auto")


# ---------------------------------------------------------------- precision of the combine and the dots
def test_float32_combine_weights_are_not_rounded_to_bf16():
  """bf16 x with float32 combine weights: y = bf16(sum_j w_j FFN_j(x)) with the sum in float32 of the
  unrounded weights. Identity experts on small integers make FFN exact, so y is known bit for bit;
  rounding the weights to bf16 first (double rounding) changes some entries."""
  T, E, d = 64, 2, 8
  rng = np.random.default_rng(seed_of("combine_f32"))
  x = jnp.asarray(rng.integers(-3, 4, (T, d)), jnp.bfloat16)
  eye = jnp.broadcast_to(jnp.eye(d, dtype=jnp.bfloat16), (E, d, d))
  ids = jnp.broadcast_to(jnp.arange(E, dtype=jnp.int32), (T, E))
  w = rng.uniform(0.05, 1.0, (T, E)).astype(np.float32)
  identity = lambda v: v
  layer = jax.jit(lambda w: sj.moe_mlp(x, ids, w, eye, eye, activation=identity)[0])
  x32 = np.asarray(x, np.float32)
  expected = np.asarray(jnp.asarray(w[:, :1] * x32 + w[:, 1:] * x32, jnp.float32).astype(jnp.bfloat16))
  y = layer(jnp.asarray(w))
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y), expected)
  # The check has teeth: bf16-rounded weights give a different answer somewhere.
  assert np.any(np.asarray(layer(jnp.asarray(w, jnp.bfloat16))) != expected)


def test_dropped_fraction_is_of_real_assignments():
  from sparsejax.moe import dropped_fraction as frac
  assert float(frac(jnp.int32(3), jnp.asarray([2, 4, 0]))) == pytest.approx(0.5)
  assert float(frac(jnp.int32(0), jnp.zeros((4,), jnp.int32))) == 0.0


@pytest.mark.parametrize("cf", [None, 1.0], ids=["dropless", "capacity"])
def test_float32_means_highest_precision(cf):
  """Every matmul of the layer, forward and backward, asks for HIGHEST with float32 inputs (XLA's GPU
  default would be TF32) and for the default with bf16 ones (whose backward must stay bf16)."""
  T, E, k, d, f = 12, 4, 2, 8, 8
  rng = np.random.default_rng(seed_of("precision", cf))
  x, w_in, w_out = rand(rng, (T, d)), rand(rng, (E, d, f)), rand(rng, (E, f, d))
  ids = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
  cw = jnp.full((T, k), 0.5, jnp.float32)

  def dots(dtype):
    def loss(x, w_in, w_out):
      y, _ = sj.moe_mlp(x, ids, cw, w_in, w_out, capacity_factor=cf, impl="ragged_dot")
      return jnp.sum(y.astype(jnp.float32))
    args = [jnp.asarray(a, dtype) for a in (x, w_in, w_out)]
    found = dot_precisions(jax.value_and_grad(loss, argnums=(0, 1, 2)), *args)
    assert len(found) >= 6, found  # two products, each with its forward, d_lhs and d_rhs
    return found

  assert all(is_highest(p) for _, p, _ in dots(jnp.float32))
  bf16 = dots(jnp.bfloat16)
  assert not any(is_highest(p) for _, p, _ in bf16)
  assert all(dt == ("bfloat16", "bfloat16") for _, _, dt in bf16), bf16  # no float32 backward


def test_expert_choice_float32_means_highest_precision():
  T, E, d, f = 12, 4, 8, 8
  rng = np.random.default_rng(seed_of("precision_ec"))
  x = jnp.asarray(rand(rng, (T, d)))
  w_in, w_out = jnp.asarray(rand(rng, (E, d, f))), jnp.asarray(rand(rng, (E, f, d)))
  r = sj.expert_choice_routing(jnp.asarray(rand(rng, (T, E))), 1.0)
  found = dot_precisions(lambda x: sj.expert_choice_mlp(x, r, w_in, w_out)[0], x)
  assert found and all(is_highest(p) for _, p, _ in found)
