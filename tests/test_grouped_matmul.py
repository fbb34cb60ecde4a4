"""grouped_matmul: every backend against the masked reference, jax.lax.ragged_dot and a numpy loop."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax as sj
from moe_testing import IMPLS, assert_close, bf16_round, rand, seed_of

# (M rows, K, N, group sizes): sum == M, sum < M (trailing rows must be zero), empty groups
# (first, middle, last), everything in one group, a single group, nothing at all.
GROUPINGS = {
    "even": (12, 8, 16, [3, 4, 5]),
    "tail_rows": (37, 8, 8, [10, 0, 7, 5]),
    "empty_first_last": (20, 8, 8, [0, 12, 8, 0]),
    "one_group_full": (9, 4, 8, [0, 0, 9, 0]),
    "single_group": (5, 8, 4, [5]),
    "all_empty": (6, 4, 4, [0, 0]),
    "M1": (1, 8, 8, [0, 1, 0]),
}


def np_grouped_matmul(lhs, rhs, gs):
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, size in enumerate(gs):
    out[start:start + size] = lhs[start:start + size] @ rhs[g]
    start += size
  return out


def _inputs(name, dtype):
  M, K, N, gs = GROUPINGS[name]
  rng = np.random.default_rng(seed_of("gmm", name, dtype))
  lhs, rhs, ct = rand(rng, (M, K)), rand(rng, (len(gs), K, N)), rand(rng, (M, N))
  if dtype == "bfloat16":
    lhs, rhs = bf16_round(lhs), bf16_round(rhs)
  return lhs, rhs, np.asarray(gs, np.int32), ct


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(GROUPINGS))
def test_matches_reference_and_ragged_dot(name, dtype, impl):
  lhs, rhs, gs, ct = _inputs(name, dtype)
  jdt = jnp.dtype(dtype)
  lhs_j, rhs_j, gs_j, ct_j = jnp.asarray(lhs, jdt), jnp.asarray(rhs, jdt), jnp.asarray(gs), jnp.asarray(ct)

  def loss(fn):
    return lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) * ct_j)

  ours = lambda a, b: sj.grouped_matmul(a, b, gs_j, impl=impl)
  out = jax.jit(ours)(lhs_j, rhs_j)
  d_lhs, d_rhs = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(lhs_j, rhs_j)
  assert out.dtype == jdt and out.shape == (lhs.shape[0], rhs.shape[2])
  assert d_lhs.dtype == jdt and d_rhs.dtype == jdt

  # The f32 masked reference on the same (rounded) values, and jax.lax.ragged_dot itself.
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  ref = lambda a, b: sj.grouped_matmul_reference(a, b, gs_j)
  lax_rd = lambda a, b: jax.lax.ragged_dot(a, b, gs_j, preferred_element_type=jnp.float32)
  rtol = 1e-5 if dtype == "float32" else 1e-2
  grad_rtol = 1e-5 if dtype == "float32" else 2e-2
  for what, fn in (("reference", ref), ("lax.ragged_dot", lax_rd)):
    assert_close(out, fn(f32(lhs), f32(rhs)), rtol, f"out vs {what}")
    g_l, g_r = jax.grad(loss(fn), argnums=(0, 1))(f32(lhs), f32(rhs))
    assert_close(d_lhs, g_l, grad_rtol, f"d_lhs vs {what}")
    assert_close(d_rhs, g_r, grad_rtol, f"d_rhs vs {what}")
  assert_close(out, np_grouped_matmul(lhs, rhs, gs), rtol, "out vs numpy loop")

  # Rows past sum(group_sizes) are exactly zero, as are their lhs gradients; empty groups get
  # exactly zero rhs gradient.
  total = int(gs.sum())
  assert np.all(np.asarray(out[total:]) == 0)
  assert np.all(np.asarray(d_lhs[total:]) == 0)
  for g in np.flatnonzero(gs == 0):
    assert np.all(np.asarray(d_rhs[g]) == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_of_grad_with_batched_group_sizes(impl):
  """Per-example gradients with shared rhs, each example with its own grouping."""
  B, M, K, N = 3, 10, 4, 6
  rng = np.random.default_rng(seed_of("gmm_vmap", impl))
  lhs = jnp.asarray(rand(rng, (B, M, K)))
  rhs = jnp.asarray(rand(rng, (2, K, N)))
  gs = jnp.asarray([[3, 4], [0, 10], [6, 0]], jnp.int32)

  def loss(a, b, g):
    return jnp.sum(jnp.sin(sj.grouped_matmul(a, b, g, impl=impl)))

  out = jax.vmap(lambda a, g: sj.grouped_matmul(a, rhs, g, impl=impl))(lhs, gs)
  grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None, 0)))(lhs, rhs, gs)
  for b in range(B):
    np.testing.assert_allclose(out[b], np_grouped_matmul(lhs[b], rhs, np.asarray(gs[b])),
                               rtol=1e-5, atol=1e-5)
    g_l, g_r = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs[b], rhs, gs[b])
    np.testing.assert_allclose(grads[0][b], g_l, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads[1][b], g_r, rtol=1e-5, atol=1e-6)


def test_auto_resolves_to_an_available_backend():
  from sparsejax.grouped_matmul import resolve_impl

  expected = "pallas" if jax.default_backend() == "gpu" else "ragged_dot"
  assert resolve_impl("auto") == expected
  assert resolve_impl("reference") == "reference"
