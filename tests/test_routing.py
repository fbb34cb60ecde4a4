"""Routers: top-k (Switch/GShard), expert choice, the dense-to-sparse gate, router logits."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax as sj
from moe_testing import IMPLS, assert_close, dot_precisions, np_moe_loop, np_top_k_routing, rand, seed_of


def _logits(T, E, seed, scale=2.0):
  return jnp.asarray(rand(np.random.default_rng(seed), (T, E), scale))


# ---------------------------------------------------------------------------- top-k
@pytest.mark.parametrize("T,E,k", [(37, 8, 1), (37, 8, 2), (5, 4, 4), (3, 1, 1), (130, 16, 3)])
def test_top_k_routing_picks_the_top_k(T, E, k):
  logits = _logits(T, E, seed_of("topk", T, E, k))
  r = jax.jit(sj.top_k_routing, static_argnums=1)(logits, k)
  assert r.expert_ids.shape == (T, k) and r.expert_ids.dtype == jnp.int32
  assert r.combine_weights.shape == (T, k) and r.combine_weights.dtype == jnp.float32
  assert r.router_probs.shape == (T, E) and r.router_probs.dtype == jnp.float32
  ids = np.asarray(r.expert_ids)
  assert np.all((ids >= 0) & (ids < E))
  assert all(len(set(row)) == k for row in ids), "ids must be distinct per token"
  ids_np, w_np, p_np = np_top_k_routing(logits, k)
  np.testing.assert_array_equal(ids, ids_np)
  np.testing.assert_allclose(r.router_probs, p_np, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(r.combine_weights, w_np, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(r.router_logits, logits)
  if k > 1:  # renormalized by default
    np.testing.assert_allclose(np.sum(r.combine_weights, -1), 1.0, rtol=1e-6)


def test_top_k_renormalize_flag():
  logits = _logits(20, 6, 1)
  p = np.asarray(jax.nn.softmax(logits))
  r1 = sj.top_k_routing(logits, 1)  # Switch: weight is the probability itself, not 1
  np.testing.assert_allclose(r1.combine_weights[:, 0], p.max(-1), rtol=1e-6)
  assert np.all(np.asarray(r1.combine_weights) < 1.0)
  r1n = sj.top_k_routing(logits, 1, renormalize=True)
  np.testing.assert_allclose(r1n.combine_weights, 1.0, rtol=1e-6)
  r2 = sj.top_k_routing(logits, 2, renormalize=False)
  np.testing.assert_allclose(r2.combine_weights, np.sort(p, -1)[:, ::-1][:, :2], rtol=1e-6)
  assert np.all(np.sum(np.asarray(r2.combine_weights), -1) < 1.0)


def test_top_k_routing_bf16_logits_run_in_float32():
  logits = _logits(16, 8, 2).astype(jnp.bfloat16)
  r = sj.top_k_routing(logits, 2)
  assert r.combine_weights.dtype == jnp.float32 and r.router_probs.dtype == jnp.float32
  _, w_np, p_np = np_top_k_routing(np.asarray(logits.astype(jnp.float32)), 2)
  np.testing.assert_allclose(r.router_probs, p_np, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(r.combine_weights, w_np, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [1, 2])
def test_top_k_routing_gradient(k):
  """d/dlogits of sum(c * combine_weights), against central differences in float64."""
  T, E = 6, 5
  logits = _logits(T, E, seed_of("topk_grad", k))
  c = rand(np.random.default_rng(3), (T, k))
  g = jax.jit(jax.grad(lambda l: jnp.sum(sj.top_k_routing(l, k).combine_weights * c)))(logits)
  l64 = np.asarray(logits, np.float64)
  fd = np.zeros_like(l64)
  eps = 1e-6
  for idx in np.ndindex(*l64.shape):
    plus, minus = l64.copy(), l64.copy()
    plus[idx] += eps
    minus[idx] -= eps
    fd[idx] = (np.sum(np_top_k_routing(plus, k)[1] * c) - np.sum(np_top_k_routing(minus, k)[1] * c)) / (2 * eps)
  np.testing.assert_allclose(g, fd, rtol=1e-4, atol=1e-6)
  assert np.any(np.abs(np.asarray(g)) > 1e-3)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_top_k_routing_weights_are_top_k_values_without_a_scatter(k):
  """The one-hot read of the picked probabilities gives lax.top_k's values and gradient exactly,
  and its backward has no scatter (top_k's transpose is one)."""
  logits = _logits(64, 8, seed_of("topk_onehot", k))
  c = jnp.asarray(rand(np.random.default_rng(4), (64, k)))
  ours = lambda l: jnp.sum(sj.top_k_routing(l, k, renormalize=False).combine_weights * c)
  plain = lambda l: jnp.sum(jax.lax.top_k(jax.nn.softmax(l, axis=-1), k)[0] * c)
  np.testing.assert_array_equal(sj.top_k_routing(logits, k, renormalize=False).combine_weights,
                                jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)[0])
  np.testing.assert_array_equal(jax.grad(ours)(logits), jax.grad(plain)(logits))
  assert "scatter" not in jax.jit(jax.grad(ours)).lower(logits).as_text()


# ---------------------------------------------------------------------------- expert choice
@pytest.mark.parametrize("T,E,cf", [(37, 4, 1.0), (16, 8, 2.0), (10, 3, 0.5), (5, 2, 4.0)])
def test_expert_choice_takes_top_c_tokens(T, E, cf):
  logits = _logits(T, E, seed_of("ec", T, E, cf))
  r = jax.jit(sj.expert_choice_routing, static_argnums=1)(logits, cf)
  C = min(T, math.ceil(cf * T / E))
  assert r.token_ids.shape == (E, C) and r.token_ids.dtype == jnp.int32
  p = np.asarray(jax.nn.softmax(logits.astype(jnp.float32)), np.float64)
  ids = np.asarray(r.token_ids)
  for e in range(E):
    assert len(set(ids[e])) == C, "an expert takes C distinct tokens"
    top = set(np.argsort(-p[:, e], kind="stable")[:C])
    assert set(ids[e]) == top, f"expert {e} must take its top-{C} tokens by probability"
    np.testing.assert_allclose(r.combine_weights[e], p[ids[e], e], rtol=1e-6)
  np.testing.assert_allclose(r.router_probs, p, rtol=1e-5, atol=1e-7)


def test_expert_choice_mlp_matches_loop_and_grads():
  T, E, d, f, cf = 12, 3, 8, 8, 1.0
  rng = np.random.default_rng(seed_of("ec_mlp"))
  x, logits = jnp.asarray(rand(rng, (T, d))), jnp.asarray(rand(rng, (T, E), 2.0))
  w_in, w_out = jnp.asarray(rand(rng, (E, d, f), 0.4)), jnp.asarray(rand(rng, (E, f, d), 0.4))
  r = jax.jit(sj.expert_choice_routing, static_argnums=1)(logits, cf)
  y, stats = jax.jit(sj.expert_choice_mlp)(x, r, w_in, w_out)
  # As token-choice: token t's slots are the experts that chose it.
  ids, ws = np.full((T, E), -1), np.zeros((T, E))
  for e in range(E):
    for c, t in enumerate(np.asarray(r.token_ids[e])):
      ids[t, e], ws[t, e] = e, float(r.combine_weights[e, c])
  assert_close(y, np_moe_loop(x, ids, ws, w_in, w_out), 1e-5, "expert choice")
  assert int(stats.num_dropped) == int(np.sum(np.all(ids < 0, axis=1)))
  np.testing.assert_array_equal(stats.tokens_per_expert, [r.token_ids.shape[1]] * E)

  # Gradients against the dense reference with the same dense weights.
  def ours(x, logits, w_in, w_out):
    return jnp.sum(jnp.sin(sj.expert_choice_mlp(x, sj.expert_choice_routing(logits, cf), w_in, w_out)[0]))

  def dense(x, logits, w_in, w_out):
    rr = sj.expert_choice_routing(logits, cf)
    dense_w = jnp.zeros((T, E)).at[rr.token_ids, jnp.arange(E)[:, None]].add(rr.combine_weights)
    ids_all = jnp.broadcast_to(jnp.arange(E), (T, E))
    return jnp.sum(jnp.sin(sj.moe_mlp_reference(x, ids_all, dense_w, w_in, w_out)))

  g = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3)))(x, logits, w_in, w_out)
  g_ref = jax.jit(jax.grad(dense, argnums=(0, 1, 2, 3)))(x, logits, w_in, w_out)
  for a, b, n in zip(g, g_ref, ("x", "logits", "w_in", "w_out")):
    assert_close(a, b, 1e-5, n)


# ---------------------------------------------------------------------------- dense-to-sparse
def test_dts_dense_at_high_temperature_sparse_at_low():
  T, E, thr = 64, 8, 1e-3
  logits = _logits(T, E, 5)
  hot = sj.dense_to_sparse_routing(logits, 100.0, thr)
  assert np.all(np.asarray(hot.expert_ids) >= 0), "every expert passes the threshold when hot"
  assert sorted(np.asarray(hot.expert_ids)[0]) == list(range(E))
  np.testing.assert_allclose(np.sum(hot.combine_weights, -1), 1.0, rtol=1e-5)  # g itself, all kept

  cold = sj.dense_to_sparse_routing(logits, 0.01, thr)
  kept = np.asarray(cold.expert_ids) >= 0
  assert np.all(kept.sum(-1) >= 1) and kept.sum(-1).mean() < 1.5
  np.testing.assert_array_equal(np.asarray(cold.expert_ids)[:, 0], np.argmax(np.asarray(logits), -1))

  dts = jax.jit(sj.dense_to_sparse_routing, static_argnums=(1, 2))  # one program a temperature, not dozens
  counts = [float((np.asarray(dts(logits, t, thr).expert_ids) >= 0).sum()) for t in (100.0, 3.0, 1.0, 0.3, 0.1, 0.01)]
  assert counts == sorted(counts, reverse=True) and counts[0] == T * E and counts[-1] < counts[0] / 4


def test_dts_no_expert_slots_and_weights():
  T, E, thr, tau = 40, 6, 0.05, 0.5
  logits = _logits(T, E, 6)
  r = jax.jit(lambda l, t: sj.dense_to_sparse_routing(l, t, thr))(logits, jnp.float32(tau))  # traced tau
  ids, w = np.asarray(r.expert_ids), np.asarray(r.combine_weights)
  gate = np.asarray(jax.nn.softmax(logits / tau))
  none = ids == sj.NO_EXPERT
  assert none.any() and (~none).any()
  assert np.all(w[none] == 0.0)
  assert np.all(w[~none] > thr)
  for t in range(T):
    expect = set(np.flatnonzero(gate[t] > thr))
    assert set(ids[t][~none[t]]) == expect
    np.testing.assert_allclose(w[t][~none[t]], gate[t][ids[t][~none[t]]], rtol=1e-5)
  np.testing.assert_allclose(r.router_probs, jax.nn.softmax(logits), rtol=1e-6)
  capped = sj.dense_to_sparse_routing(logits, 100.0, thr, max_k=2)
  assert capped.expert_ids.shape == (T, 2) and np.all(np.asarray(capped.expert_ids) >= 0)


def test_dts_noise_only_with_rng():
  logits = _logits(16, 4, 7)
  a = sj.dense_to_sparse_routing(logits, 1.0, 0.1)
  b = sj.dense_to_sparse_routing(logits, 1.0, 0.1)
  np.testing.assert_array_equal(a.combine_weights, b.combine_weights)
  n1 = sj.dense_to_sparse_routing(logits, 1.0, 0.1, rng=jax.random.key(0))
  n2 = sj.dense_to_sparse_routing(logits, 1.0, 0.1, rng=jax.random.key(1))
  assert not np.allclose(n1.combine_weights, a.combine_weights)
  assert not np.allclose(n1.combine_weights, n2.combine_weights)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cf", [None, 1.0])
def test_moe_mlp_with_dts_routing_matches_reference(impl, cf):
  T, E, d, f = 30, 4, 8, 8
  rng = np.random.default_rng(seed_of("dts_moe", impl, cf))
  x, logits = jnp.asarray(rand(rng, (T, d))), jnp.asarray(rand(rng, (T, E), 2.0))
  w_in, w_out = jnp.asarray(rand(rng, (E, d, f), 0.4)), jnp.asarray(rand(rng, (E, f, d), 0.4))
  cap = None if cf is None else sj.capacity(T, E, E, cf)

  def run(fn, x, logits):
    r = sj.dense_to_sparse_routing(logits, 0.5, 0.05)
    return fn(x, r.expert_ids, r.combine_weights), r

  ours = lambda x, i, w: sj.moe_mlp(x, i, w, w_in, w_out, capacity_factor=cf, impl=impl)[0]
  ref = lambda x, i, w: sj.moe_mlp_reference(x, i, w, w_in, w_out, capacity=cap)
  y, r = jax.jit(lambda x, l: run(ours, x, l))(x, logits)
  assert np.any(np.asarray(r.expert_ids) == sj.NO_EXPERT)
  assert_close(y, jax.jit(lambda x, l: run(ref, x, l))(x, logits)[0], 1e-5, "y")
  assert_close(y, np_moe_loop(x, np.asarray(r.expert_ids), r.combine_weights, w_in, w_out,
                              capacity=cap), 1e-5, "loop")
  loss = lambda fn: lambda x, l: jnp.sum(jnp.sin(run(fn, x, l)[0]))
  g = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(x, logits)
  g_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1)))(x, logits)
  assert_close(g[0], g_ref[0], 1e-5, "dx")
  assert_close(g[1], g_ref[1], 1e-5, "dlogits")


def test_dts_temperature_schedule():
  sched = sj.dts_temperature_schedule(2.0, 0.03, 1000)
  np.testing.assert_allclose(sched(0), 2.0, rtol=1e-6)
  np.testing.assert_allclose(sched(500), math.sqrt(2.0 * 0.03), rtol=1e-5)  # geometric
  np.testing.assert_allclose(sched(1000), 0.03, rtol=1e-5)
  np.testing.assert_allclose(sched(10_000), 0.03, rtol=1e-5)
  taus = np.asarray(jax.vmap(sched)(jnp.arange(0, 1200, 50)))
  assert np.all(np.diff(taus) <= 0)
  np.testing.assert_allclose(jax.jit(sched)(jnp.int32(250)), 2.0 * (0.03 / 2.0) ** 0.25, rtol=1e-5)


# ---------------------------------------------------------------------------- router logits
def test_router_logits_jitter_only_with_rng():
  rng = np.random.default_rng(8)
  x, w = jnp.asarray(rand(rng, (16, 8))), jnp.asarray(rand(rng, (8, 4)))
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  np.testing.assert_allclose(sj.router_logits(x, w), exact, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(sj.router_logits(x, w, jitter_eps=0.1), exact, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(sj.router_logits(x, w, rng=jax.random.key(0)), exact, rtol=1e-5, atol=1e-5)
  eps = 0.1
  noisy = np.asarray(sj.router_logits(x, w, jitter_eps=eps, rng=jax.random.key(0)))
  assert not np.allclose(noisy, exact, rtol=1e-3)
  bound = eps * np.abs(np.asarray(x)) @ np.abs(np.asarray(w))  # |(x*u - x) W| <= eps |x| |W|
  assert np.all(np.abs(noisy - exact) <= bound + 1e-5)
  again = sj.router_logits(x, w, jitter_eps=eps, rng=jax.random.key(0))
  np.testing.assert_array_equal(noisy, again)


def test_router_logits_bf16_inputs_compute_in_float32():
  rng = np.random.default_rng(9)
  x = jnp.asarray(rand(rng, (64, 256))).astype(jnp.bfloat16)
  w = jnp.asarray(rand(rng, (256, 8))).astype(jnp.bfloat16)
  out = sj.router_logits(x, w)
  assert out.dtype == jnp.float32
  exact = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
  # A bf16 matmul would be off by ~1e-2 relative; float32 is off by ~1e-6.
  assert_close(out, exact, 1e-5, "router logits")


@pytest.mark.parametrize("tokens,experts", [(48, 8), (1, 8), (48, 1)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_router_logits_ask_for_float32_accuracy_where_the_answer_is_float32(dtype, tokens, experts):
  """A GPU reads a default-precision float32 dot as TF32 (~1e-3), which the CPU cannot show, so the
  jaxpr is read: the logits and dW_r ask for six bf16 passes (float32 accuracy); dx too for a float32
  x, while a bf16 x's gradient, rounded to bf16, keeps the default. Values and gradients against
  float64, and dx in x's dtype. One token and one expert are the shapes XLA:GPU rewrites out of a dot
  (routing._matmul); run compiled on a GPU, these cases check that the padding keeps them accurate."""
  rng = np.random.default_rng(seed_of("router_precision", dtype, str(tokens), str(experts)))
  x = jnp.asarray(rand(rng, (tokens, 64)), dtype)
  w = jnp.asarray(rand(rng, (64, experts)))
  g = rand(rng, (tokens, experts))
  loss = lambda x, w: jnp.sum(sj.router_logits(x, w) * g)
  x6 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6
  found = [p for _, p, _ in dot_precisions(jax.grad(loss, argnums=(0, 1)), x, w)]
  assert sorted(map(str, found)) == sorted(map(str, [x6, x6, x6 if dtype == "float32" else None])), found
  dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
  x64, w64 = np.asarray(x.astype(jnp.float32), np.float64), np.asarray(w, np.float64)
  assert dx.dtype == x.dtype and dw.dtype == jnp.float32
  assert_close(dw, x64.T @ g, 1e-5, "dW_r")
  assert_close(dx.astype(jnp.float32), g @ w64.T, 1e-5 if dtype == "float32" else 1e-2, "dx")
  assert_close(sj.router_logits(x, w), x64 @ w64, 1e-5, "logits")


def test_router_logits_jitter_gradient_is_the_product_rule():
  """With jitter the product's input is x * u: dx = u * (g W^T), in x's dtype."""
  rng = np.random.default_rng(seed_of("router_jitter_grad"))
  x, w, g = jnp.asarray(rand(rng, (32, 16))), jnp.asarray(rand(rng, (16, 4))), rand(rng, (32, 4))
  key, eps = jax.random.key(3), 0.1
  dx = jax.grad(lambda x: jnp.sum(sj.router_logits(x, w, jitter_eps=eps, rng=key) * g))(x)
  u = np.asarray(jax.random.uniform(key, x.shape, jnp.float32, 1.0 - eps, 1.0 + eps), np.float64)
  assert_close(dx, u * (g @ np.asarray(w, np.float64).T), 1e-5, "dx with jitter")
