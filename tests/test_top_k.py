"""top_k_small: lax.top_k's values (bit for bit), indices, order and gradient, by k argmax passes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax as sj
from moe_testing import rand, seed_of

NAN, INF = np.float32(np.nan), np.float32(np.inf)


def _hard_rows(rng: np.random.Generator, E: int) -> np.ndarray:
  """Rows that break a naive top-k: ties, all equal, -inf (some and all), +inf, NaN of both signs, +-0."""
  ties = rng.integers(-2, 3, (8, E)).astype(np.float32)  # many duplicates
  equal = np.full((2, E), 0.5, np.float32)
  minus_inf = np.where(rng.random((6, E)) < 0.5, -INF, rand(rng, (6, E)))
  minus_inf[0] = -INF
  minus_inf[1, : E // 2] = -INF
  special = rng.choice(np.array([NAN, -NAN, INF, -INF, 0.0, -0.0, 1.0], np.float32), (8, E))
  return np.concatenate([ties, equal, minus_inf, special])


def _bits(a) -> np.ndarray:
  a = np.asarray(a)  # viewed on the host: a bitcast on the device compiled a program per shape
  return a.view(np.dtype(f"int{a.dtype.itemsize * 8}"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("E", [1, 2, 8, 64])
def test_top_k_small_is_lax_top_k(E, dtype):
  """Random rows and hard rows (ties, -inf, +inf, NaN, -0), k = 1..min(8, E): the same bits and ids."""
  rng = np.random.default_rng(seed_of("top_k_small", E, str(dtype)))
  x = jnp.asarray(np.concatenate([rand(rng, (24, E)), _hard_rows(rng, E)])).astype(dtype)
  for k in range(1, min(8, E) + 1):
    values, ids = jax.jit(sj.top_k_small, static_argnums=1)(x, k)
    want_values, want_ids = jax.lax.top_k(x, k)
    assert values.dtype == dtype and ids.dtype == jnp.int32 and ids.shape == (x.shape[0], k)
    np.testing.assert_array_equal(ids, want_ids, err_msg=f"k={k}")
    np.testing.assert_array_equal(_bits(values), _bits(want_values), err_msg=f"k={k}")
    assert all(len(set(row)) == k for row in np.asarray(ids).tolist()), "k distinct ids per row"


def test_top_k_small_never_picks_an_index_twice():
  """A -NaN with every bit set has the lowest key of all, the one taken entries drop to: still distinct."""
  lowest = jax.lax.bitcast_convert_type(jnp.int32(-1), jnp.float32)  # 0xffffffff
  x = jnp.stack([jnp.full((6,), lowest), jnp.asarray([lowest, 1.0, lowest, -INF, lowest, NAN])])
  values, ids = sj.top_k_small(x, 6)
  np.testing.assert_array_equal(ids, [[0, 1, 2, 3, 4, 5], [5, 1, 3, 0, 2, 4]])
  np.testing.assert_array_equal(ids, jax.lax.top_k(x, 6)[1])
  np.testing.assert_array_equal(_bits(values), _bits(jax.lax.top_k(x, 6)[0]))


@pytest.mark.parametrize("k", [1, 3])
def test_top_k_small_gradient_is_lax_top_k_s_without_a_scatter(k):
  x = jnp.asarray(rand(np.random.default_rng(seed_of("top_k_small_grad", k)), (32, 16)))
  c = jnp.asarray(rand(np.random.default_rng(1), (32, k)))
  ours = lambda x: jnp.sum(jnp.sin(sj.top_k_small(x, k)[0]) * c)
  plain = lambda x: jnp.sum(jnp.sin(jax.lax.top_k(x, k)[0]) * c)
  np.testing.assert_array_equal(jax.jit(jax.grad(ours))(x), jax.grad(plain)(x))
  assert "scatter" not in jax.jit(jax.grad(ours)).lower(x).as_text()
  # Forward mode too, and through vmap over a leading axis.
  dx = jnp.asarray(rand(np.random.default_rng(2), (32, 16)))
  np.testing.assert_array_equal(jax.jvp(lambda x: sj.top_k_small(x, k)[0], (x,), (dx,))[1],
                                jax.jvp(lambda x: jax.lax.top_k(x, k)[0], (x,), (dx,))[1])
  batched = jax.vmap(lambda x: sj.top_k_small(x, k))(x.reshape(4, 8, 16))
  np.testing.assert_array_equal(batched[1], jax.lax.top_k(x, k)[1].reshape(4, 8, k))


def test_top_k_small_falls_back_to_lax_top_k():
  x = jnp.asarray(rand(np.random.default_rng(5), (8, 16)))
  for args in ((x, 12), (jnp.round(x * 4).astype(jnp.int32), 2)):  # k > MAX_PASSES_K; integers
    np.testing.assert_array_equal(sj.top_k_small(*args)[1], jax.lax.top_k(*args)[1])
  with pytest.raises(ValueError, match="k must be"):
    sj.top_k_small(x, 17)


# ---------------------------------------------------------------------------- the routers using it
def _top_k_routing_before(logits, k, renormalize):
  """top_k_routing as it was, with lax.top_k."""
  logits = logits.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  ids = jax.lax.top_k(jax.lax.stop_gradient(probs), k)[1]
  weights = jnp.sum(probs[:, None, :] * jax.nn.one_hot(ids, probs.shape[1], dtype=probs.dtype), axis=-1)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return ids.astype(jnp.int32), weights


def _dts_before(logits, temperature, threshold, max_k):
  """dense_to_sparse_routing's ids and weights as they were, with lax.top_k."""
  weights, ids = jax.lax.top_k(jax.nn.softmax(logits / temperature, axis=-1), max_k)
  keep = weights > threshold
  return jnp.where(keep, ids, sj.NO_EXPERT).astype(jnp.int32), jnp.where(keep, weights, 0.0)


@pytest.mark.parametrize("k", [1, 2])
def test_routers_unchanged_bit_for_bit(k):
  """top_k_routing and the dense-to-sparse gate: the same ids, weights and gradients as with lax.top_k."""
  rng = np.random.default_rng(seed_of("routers_unchanged", k))
  ties = rng.integers(-1, 2, (4, 64)).astype(np.float32)
  logits = jnp.asarray(np.concatenate([rand(rng, (60, 64), 2.0), ties]))
  c = jnp.asarray(rand(rng, (64, k)))
  ids_weights = lambda r: (r.expert_ids, r.combine_weights)
  routers = {
      "top_k": (lambda l: ids_weights(sj.top_k_routing(l, k)), lambda l: _top_k_routing_before(l, k, k > 1)),
      "dts": (lambda l: ids_weights(sj.dense_to_sparse_routing(l, 0.5, 0.02, max_k=k)),
              lambda l: _dts_before(l, 0.5, 0.02, k)),
  }
  loss = lambda fn: lambda l: jnp.sum(jnp.sin(fn(l)[1]) * c)
  for name, (new, old) in routers.items():
    ids, weights = jax.jit(new)(logits)
    want_ids, want_weights = jax.jit(old)(logits)
    np.testing.assert_array_equal(ids, want_ids, err_msg=name)
    np.testing.assert_array_equal(_bits(weights), _bits(want_weights), err_msg=name)
    g, want_g = jax.grad(loss(new))(logits), jax.grad(loss(old))(logits)  # op by op
    np.testing.assert_array_equal(_bits(g), _bits(want_g), err_msg=name)
    g, want_g = jax.jit(jax.grad(loss(new)))(logits), jax.jit(jax.grad(loss(old)))(logits)
    if name == "top_k":  # the ids carry no gradient: the same program after them
      np.testing.assert_array_equal(_bits(g), _bits(want_g))
    # Compiled, the gate gets the same bits from the top-k backward, but the softmax backward after
    # it fuses differently (after a select, not a scatter), so its row sum rounds differently and
    # g - sum(g p) cancels: equal to 1e-6 of the largest.
    np.testing.assert_allclose(g, want_g, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(want_g))), err_msg=name)
