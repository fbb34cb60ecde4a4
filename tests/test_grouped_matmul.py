"""grouped_matmul: every backend against the masked reference, jax.lax.ragged_dot and a numpy loop."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax as sj
from moe_testing import IMPLS, assert_close, bf16_round, dot_precisions, is_highest, rand, seed_of

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


def _loss(fn, ct):
  return lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) * ct)


@functools.lru_cache(maxsize=None)
def _references(name, dtype):
  """The inputs, and the f32 masked reference's and jax.lax.ragged_dot's output and gradients on the
  same (rounded) values: shared by the impls of a case (each jitted, one program apiece)."""
  lhs, rhs, gs, ct = _inputs(name, dtype)
  gs_j, ct_j = jnp.asarray(gs), jnp.asarray(ct)
  ref = lambda a, b: sj.grouped_matmul_reference(a, b, gs_j)
  # HIGHEST: a GPU computes a float32 ragged_dot in TF32 (~1e-3) by default
  lax_rd = lambda a, b: jax.lax.ragged_dot(a, b, gs_j, precision=jax.lax.Precision.HIGHEST,
                                           preferred_element_type=jnp.float32)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  results = {what: jax.jit(lambda a, b, fn=fn: (fn(a, b), jax.grad(_loss(fn, ct_j), argnums=(0, 1))(a, b)))(
      f32(lhs), f32(rhs)) for what, fn in (("reference", ref), ("lax.ragged_dot", lax_rd))}
  return (lhs, rhs, gs, ct), results


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(GROUPINGS))
def test_matches_reference_and_ragged_dot(name, dtype, impl):
  (lhs, rhs, gs, ct), references = _references(name, dtype)
  jdt = jnp.dtype(dtype)
  lhs_j, rhs_j, gs_j, ct_j = jnp.asarray(lhs, jdt), jnp.asarray(rhs, jdt), jnp.asarray(gs), jnp.asarray(ct)

  ours = lambda a, b: sj.grouped_matmul(a, b, gs_j, impl=impl)
  # The output rides along as aux: one program gives the values and the gradients.
  loss = lambda a, b: (lambda out: (jnp.sum(out.astype(jnp.float32) * ct_j), out))(ours(a, b))
  (d_lhs, d_rhs), out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(lhs_j, rhs_j)
  assert out.dtype == jdt and out.shape == (lhs.shape[0], rhs.shape[2])
  assert d_lhs.dtype == jdt and d_rhs.dtype == jdt

  # The f32 masked reference on the same (rounded) values, and jax.lax.ragged_dot itself.
  rtol = 1e-5 if dtype == "float32" else 1e-2
  grad_rtol = 1e-5 if dtype == "float32" else 2e-2
  for what, (want, (g_l, g_r)) in references.items():
    assert_close(out, want, rtol, f"out vs {what}")
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

  out = jax.jit(jax.vmap(lambda a, g: sj.grouped_matmul(a, rhs, g, impl=impl)))(lhs, gs)
  grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None, 0)))(lhs, rhs, gs)
  grad1 = jax.jit(jax.grad(loss, argnums=(0, 1)))  # one compile serves every example
  for b in range(B):
    np.testing.assert_allclose(out[b], np_grouped_matmul(lhs[b], rhs, np.asarray(gs[b])),
                               rtol=1e-5, atol=1e-5)
    g_l, g_r = grad1(lhs[b], rhs, gs[b])
    np.testing.assert_allclose(grads[0][b], g_l, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads[1][b], g_r, rtol=1e-5, atol=1e-6)


def test_auto_resolves_to_an_available_backend():
  from sparsejax.grouped_matmul import resolve_impl

  expected = "pallas" if jax.default_backend() == "gpu" else "ragged_dot"
  assert resolve_impl("auto") == expected
  assert resolve_impl("reference") == "reference"


# ------------------------------------------------------------------------------------------------
# The rest of jax.lax.ragged_dot's arguments: preferred_element_type, mixed dtypes, group_offset,
# precision. Checked against jax.lax.ragged_dot itself, forward and gradients, on every impl.

HI = jax.lax.Precision.HIGHEST


def _value_and_grads(fn, lhs, rhs, ct):
  """fn(lhs, rhs) and the gradients of <fn(lhs, rhs), ct> (jitted)."""
  loss = lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) * ct)
  return jax.jit(lambda a, b: (fn(a, b), jax.grad(loss, argnums=(0, 1))(a, b)))(lhs, rhs)


@pytest.mark.parametrize("impl", IMPLS)
def test_preferred_element_type(impl):
  """bf16 inputs, float32 output (the sum is not rounded to bf16); and float32 inputs, bf16 output."""
  lhs, rhs, gs, ct = _inputs("tail_rows", "bfloat16")
  gs, ct = jnp.asarray(gs), jnp.asarray(ct)
  for in_dt, out_dt, rtol in ((jnp.bfloat16, jnp.float32, 1e-5), (jnp.float32, jnp.bfloat16, 1e-2)):
    a, b = jnp.asarray(lhs, in_dt), jnp.asarray(rhs, in_dt)
    ours = lambda a, b: sj.grouped_matmul(a, b, gs, preferred_element_type=out_dt, impl=impl)
    theirs = lambda a, b: jax.lax.ragged_dot(a, b, gs, precision=HI, preferred_element_type=out_dt)
    out, (d_lhs, d_rhs) = _value_and_grads(ours, a, b, ct)
    ref, (g_lhs, g_rhs) = _value_and_grads(theirs, a, b, ct)
    assert out.dtype == out_dt and d_lhs.dtype == in_dt and d_rhs.dtype == in_dt
    what = f"{jnp.dtype(in_dt).name}->{jnp.dtype(out_dt).name}"
    assert_close(out, ref, rtol, f"out {what}")
    assert_close(out, np_grouped_matmul(lhs, rhs, np.asarray(gs)), rtol, f"out vs numpy {what}")
    # jax.lax.ragged_dot rounds its own gradients to the preferred (bf16) type as well.
    grad_rtol = 2e-2
    assert_close(d_lhs, g_lhs, grad_rtol, f"d_lhs {what}")
    assert_close(d_rhs, g_rhs, grad_rtol, f"d_rhs {what}")


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_input_dtypes(impl):
  """bf16 lhs with float32 rhs and the reverse: computed and returned in float32, as ragged_dot does."""
  lhs, rhs, gs, ct = _inputs("empty_first_last", "bfloat16")
  gs, ct = jnp.asarray(gs), jnp.asarray(ct)
  for lhs_dt, rhs_dt in ((jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)):
    a, b = jnp.asarray(lhs, lhs_dt), jnp.asarray(rhs, rhs_dt)
    ours = lambda a, b: sj.grouped_matmul(a, b, gs, impl=impl)
    theirs = lambda a, b: jax.lax.ragged_dot(a, b, gs, precision=HI)
    out, (d_lhs, d_rhs) = _value_and_grads(ours, a, b, ct)
    ref, (g_lhs, g_rhs) = _value_and_grads(theirs, a, b, ct)
    assert out.dtype == ref.dtype == jnp.float32
    assert d_lhs.dtype == lhs_dt and d_rhs.dtype == rhs_dt
    assert_close(out, ref, 1e-5, "out")
    assert_close(d_lhs, g_lhs, 1e-5 if lhs_dt == jnp.float32 else 1e-2, "d_lhs")
    assert_close(d_rhs, g_rhs, 1e-5 if rhs_dt == jnp.float32 else 1e-2, "d_rhs")


# Five groups of 20 rows (18 used); rhs holds two of them.
OFFSET_SIZES, OFFSET_M, OFFSET_LOCAL = [4, 0, 6, 3, 5], 20, 2


@pytest.mark.parametrize("impl", IMPLS)
def test_group_offset_computes_only_its_groups(impl):
  """rhs[j] serves group group_offset + j of group_sizes; all other rows are zero. jax.lax.ragged_dot
  has no group_offset (NotImplementedError in jax 0.10), so the expectation is ragged_dot on the
  selected groups' rows, sliced out by hand: out[s:s+n] = ragged_dot(lhs[s:], rhs, sizes[o:o+2])[:n]."""
  rng = np.random.default_rng(seed_of("offset", impl))
  gs_np = np.asarray(OFFSET_SIZES, np.int32)
  lhs = jnp.asarray(rand(rng, (OFFSET_M, 8)))
  rhs = jnp.asarray(rand(rng, (OFFSET_LOCAL, 8, 16)))
  ct = jnp.asarray(rand(rng, (OFFSET_M, 16)))
  gs = jnp.asarray(gs_np)

  def ours(a, b, offset):
    return sj.grouped_matmul(a, b, gs, group_offset=offset, impl=impl)

  def loss(a, b, offset):
    return jnp.sum(ours(a, b, offset) * ct)

  # The offset is traced: one compile serves every offset.
  run = jax.jit(lambda a, b, o: (ours(a, b, o), jax.grad(loss, argnums=(0, 1))(a, b, o)))
  for o in range(len(OFFSET_SIZES) - OFFSET_LOCAL + 1):
    start, local = int(gs_np[:o].sum()), gs_np[o:o + OFFSET_LOCAL]
    n = int(local.sum())

    def theirs(a, b):
      part = jax.lax.ragged_dot(a[start:], b, jnp.asarray(local), precision=HI)[:n]
      return jnp.zeros((OFFSET_M, b.shape[2]), part.dtype).at[start:start + n].set(part)

    offset = jnp.asarray([o] if o % 2 else o, jnp.int32)  # ragged_dot's [1] shape, and a scalar
    out, (d_lhs, d_rhs) = run(lhs, rhs, offset)
    ref, (g_lhs, g_rhs) = _value_and_grads(theirs, lhs, rhs, ct)
    assert_close(out, ref, 1e-5, f"out, offset {o}")
    assert_close(d_lhs, g_lhs, 1e-5, f"d_lhs, offset {o}")
    assert_close(d_rhs, g_rhs, 1e-5, f"d_rhs, offset {o}")
    outside = np.ones(OFFSET_M, bool)
    outside[start:start + n] = False
    assert np.all(np.asarray(out)[outside] == 0) and np.all(np.asarray(d_lhs)[outside] == 0)
    ref_impl = sj.grouped_matmul_reference(lhs, rhs, gs, group_offset=offset)
    assert_close(out, ref_impl, 1e-5, f"out vs reference, offset {o}")


def test_group_offset_under_vmap():
  """Per-example offsets (each example its own shard of groups), as expert parallelism would use."""
  rng = np.random.default_rng(seed_of("offset_vmap"))
  lhs = jnp.asarray(rand(rng, (3, OFFSET_M, 4)))
  rhs = jnp.asarray(rand(rng, (OFFSET_LOCAL, 4, 4)))
  gs = jnp.asarray(OFFSET_SIZES, jnp.int32)
  offsets = jnp.asarray([0, 3, 1], jnp.int32)
  f = lambda a, o: sj.grouped_matmul(a, rhs, gs, group_offset=o, impl="ragged_dot")
  out = jax.jit(jax.vmap(f))(lhs, offsets)
  for b in range(3):
    np.testing.assert_allclose(out[b], sj.grouped_matmul_reference(lhs[b], rhs, gs, group_offset=offsets[b]),
                               rtol=1e-5, atol=1e-6)


def test_precision_reaches_the_dot():
  """float32 operands get HIGHEST (no TF32 on GPU) in the forward and backward products; bf16 ones
  keep the default; an explicit precision is passed through."""
  gs = jnp.asarray([3, 4], jnp.int32)
  a, b = jnp.ones((7, 4), jnp.float32), jnp.ones((2, 4, 5), jnp.float32)
  half = lambda v: v.astype(jnp.bfloat16)

  def dots(a, b, **kw):
    loss = lambda a, b: jnp.sum(sj.grouped_matmul(a, b, gs, impl="ragged_dot", **kw).astype(jnp.float32))
    found = dot_precisions(jax.value_and_grad(loss, argnums=(0, 1)), a, b)
    assert len(found) >= 3, found  # forward, d_lhs, d_rhs
    return [p for _, p, _ in found]

  assert all(is_highest(p) for p in dots(a, b))
  assert all(is_highest(p) for p in dots(half(a), b))  # mixed: float32 compute
  assert not any(is_highest(p) for p in dots(half(a), half(b)))
  default = jax.lax.Precision.DEFAULT
  assert all(p in (default, (default, default)) for p in dots(a, b, precision=default))


def test_ragged_dot_arguments_are_checked():
  lhs, rhs, gs = jnp.ones((6, 4)), jnp.ones((2, 4, 3)), jnp.asarray([1, 2, 3, 0], jnp.int32)
  f = lambda **kw: sj.grouped_matmul(**{**dict(lhs=lhs, rhs=rhs, group_sizes=gs, group_offset=1,
                                                impl="reference"), **kw})
  with pytest.raises(ValueError, match=r"group_offset=3 must be in \[0, 2\]"):
    f(group_offset=3)
  with pytest.raises(ValueError, match="group_offset must have shape"):
    f(group_offset=jnp.asarray([1, 2]))
  with pytest.raises(TypeError, match="group_offset must be an integer"):
    f(group_offset=jnp.asarray(1.0))
  with pytest.raises(ValueError, match="has only 1"):
    f(group_sizes=gs[:1], group_offset=0)
  with pytest.raises(ValueError, match="4 entries but rhs has 2 groups"):
    f(group_offset=None)
  with pytest.raises(TypeError, match="preferred_element_type must be a floating dtype"):
    f(preferred_element_type=jnp.int32)
  with pytest.raises(TypeError, match="rhs must be a floating-point array"):
    f(rhs=jnp.ones((2, 4, 3), jnp.int8))
  # Unsigned group sizes (tokamax passes uint32) are sizes like any other.
  np.testing.assert_array_equal(f(group_sizes=gs.astype(jnp.uint32)), f())
