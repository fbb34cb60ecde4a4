"""decode_qkv: the per-(row, head) Pallas Triton kernel (interpret mode off the GPU) against a float64 oracle."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.kernels.decode_qkv import decode_qkv, decode_qkv_reference
from tests.moe_testing import seed_of

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}
BASE = 10_000.0


def _oracle(parts, k_cache, v_cache, index, start, dtype):
  """float64 loops: the summed row rounded to dtype, each pair (x_i, x_{i+dh/2}) turned by p base^(-2i/dh)."""
  splits, _, width = parts.shape
  b, _, h, dh = k_cache.shape
  qkv = np.asarray(jnp.asarray(np.asarray(parts, np.float64).sum(0)[:b], jnp.float32).astype(dtype), np.float64)
  qkv = qkv.reshape(b, 3, h, dh)
  q, keys, values = np.zeros((b, h, dh)), np.asarray(k_cache, np.float64), np.asarray(v_cache, np.float64)
  slot = min(index, keys.shape[1] - 1)  # a write past the end lands on the last slot
  for r in range(b):
    p = index - start[r]
    for hh in range(h):
      for which, out in ((0, None), (1, keys)):
        x = qkv[r, which, hh]
        y = np.empty(dh)
        for i in range(dh // 2):
          a = p * BASE ** (-2.0 * i / dh)
          y[i] = x[i] * np.cos(a) - x[i + dh // 2] * np.sin(a)
          y[i + dh // 2] = x[i + dh // 2] * np.cos(a) + x[i] * np.sin(a)
        if out is None:
          q[r, hh] = y
        else:
          out[r, slot, hh] = y
      values[r, slot, hh] = qkv[r, 2, hh]
  return q, keys, values


# (rows, parts, padded rows, slots, heads, head_dim, start per row, slot): one row, several rows with
# left padding (start > index: a padding row's negative position), the first and the last slot, and
# past the end (the decode loop's dropped steps: the write clamps onto the last slot, RoPE does not).
CASES = {
    "one_row": (1, 8, 1, 40, 4, 64, [0], 17),
    "padded_rows": (3, 5, 16, 24, 2, 32, [0, 4, 12], 9),
    "first_slot": (2, 1, 2, 16, 3, 16, [0, 0], 0),
    "last_slot": (2, 3, 2, 20, 2, 32, [5, 0], 19),
    "past_the_end": (3, 2, 16, 12, 2, 16, [0, 6, 3], 15),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_oracle_and_reference(name, dtype):
  b, splits, rows, s, h, dh, start, index = CASES[name]
  rng = np.random.default_rng(seed_of("decode_qkv", name, str(dtype)))
  parts = jnp.asarray(rng.standard_normal((splits, rows, 3 * h * dh)), jnp.float32)
  k_cache, v_cache = (jnp.asarray(rng.standard_normal((b, s, h, dh)), dtype) for _ in range(2))
  start, index = jnp.asarray(start, jnp.int32), jnp.asarray(index, jnp.int32)
  got = jax.jit(lambda *a: decode_qkv(*a, rope_base=BASE, dtype=dtype, impl="triton"))(
      parts, k_cache, v_cache, index, start)
  want = _oracle(parts, k_cache, v_cache, int(index), np.asarray(start), dtype)
  ref = jax.jit(decode_qkv_reference, static_argnums=(5, 6))(parts, k_cache, v_cache, index, start, BASE, dtype)
  for g, w, r in zip(got, want, ref):
    assert g.dtype == dtype and g.shape == r.shape
    np.testing.assert_allclose(np.asarray(g, np.float64), w, **TOL[dtype])
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(r, np.float64), **TOL[dtype])
  # every other slot of the caches is left as it was
  others = np.arange(s) != min(int(index), s - 1)
  np.testing.assert_array_equal(np.asarray(got[1])[:, others], np.asarray(k_cache)[:, others])
  np.testing.assert_array_equal(np.asarray(got[2])[:, others], np.asarray(v_cache)[:, others])


def test_gradients_are_the_references():
  rng = np.random.default_rng(3)
  parts = jnp.asarray(rng.standard_normal((4, 2, 3 * 2 * 32)), jnp.float32)
  k_cache, v_cache = (jnp.asarray(rng.standard_normal((2, 8, 2, 32)), jnp.float32) for _ in range(2))
  start, index = jnp.asarray([0, 2], jnp.int32), jnp.asarray(5, jnp.int32)
  cts = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in [(2, 2, 32), (2, 8, 2, 32), (2, 8, 2, 32)]]
  loss = lambda impl: lambda p, k, v: sum(jnp.sum(o * c) for o, c in zip(
      decode_qkv(p, k, v, index, start, rope_base=BASE, dtype=jnp.float32, impl=impl), cts))
  got = jax.jit(jax.grad(loss("triton"), argnums=(0, 1, 2)))(parts, k_cache, v_cache)
  want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(parts, k_cache, v_cache)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args,match", [
    (dict(impl="cuda"), "impl must be one of"),
    (dict(parts=jnp.zeros((2, 2, 96))), r"parts must be \[splits, rows >= 3, 3 \* 2 \* 16 = 96\]"),
    (dict(parts=jnp.zeros((2, 3, 95))), r"3 \* 2 \* 16 = 96"),
    (dict(v_cache=jnp.zeros((3, 8, 2, 8))), "must have one shape"),
    (dict(start=jnp.zeros((2,), jnp.int32)), r"one entry per row \(3\)"),
    (dict(index=jnp.zeros((1,), jnp.int32)), "index must have rank 0"),
    (dict(index=jnp.asarray(1.0)), "index must be an integer"),
    (dict(k_cache=jnp.zeros((3, 8, 2, 12)), v_cache=jnp.zeros((3, 8, 2, 12)), parts=jnp.zeros((1, 3, 72)),
          impl="triton"), "head_dim / 2 a power of two"),
])
def test_bad_inputs_fail_with_clear_errors(args, match):
  call = dict(parts=jnp.zeros((2, 4, 96)), k_cache=jnp.zeros((3, 8, 2, 16)), v_cache=jnp.zeros((3, 8, 2, 16)),
              index=jnp.asarray(1, jnp.int32), start=jnp.zeros((3,), jnp.int32), impl="auto")
  call.update(args)
  with pytest.raises((ValueError, TypeError), match=match):
    decode_qkv(**call, rope_base=BASE, dtype=jnp.float32)


# decode_qkv_product: (d, heads, head_dim, slots, start, index, norm): the norm folded or not, several programs a
# head half (head_dim 64: 4 of 8 columns), a negative position (start > index), and a write past the end.
PRODUCT_CASES = {
    "norm_folded": (128, 3, 64, 20, 0, 11, True),
    "no_norm": (64, 2, 32, 16, 3, 9, False),
    "padding_row_past_the_end": (256, 2, 16, 8, 10, 12, True),
}


def _product_oracle(x, w, g, eps, k_cache, v_cache, index, start, dtype):
  """float64: xn = rms_norm(x, g, eps) (x without a norm), xn W as the one part of _oracle."""
  x64 = np.asarray(x, np.float64)
  if g is not None:
    x64 = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + eps) * np.asarray(g, np.float64)
  qkv = x64 @ np.asarray(w, np.float64)
  return _oracle(qkv[None], k_cache, v_cache, index, start, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(PRODUCT_CASES))
def test_product_kernel_equals_oracle_and_reference(name, dtype):
  """The qkv product, RoPE and the cache write in one kernel at one row, against float64 and the reference."""
  from sparsejax.kernels.decode_qkv import decode_qkv_product, decode_qkv_product_reference, runs_product_kernel
  d, h, dh, s, start, index, normed = PRODUCT_CASES[name]
  rng = np.random.default_rng(seed_of("decode_qkv_product", name, str(dtype)))
  x = jnp.asarray(rng.standard_normal((1, d)) * 2.0, dtype)
  w = jnp.asarray(rng.standard_normal((d, 3 * h * dh)) / np.sqrt(d), dtype)
  g = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), jnp.float32) if normed else None
  k_cache, v_cache = (jnp.asarray(rng.standard_normal((1, s, h, dh)), dtype) for _ in range(2))
  start, index = jnp.asarray([start], jnp.int32), jnp.asarray(index, jnp.int32)
  norm = None if g is None else (g, 1e-6)
  assert runs_product_kernel(1, d, dh, "triton") and not runs_product_kernel(2, d, dh, "triton")
  got = jax.jit(lambda *a: decode_qkv_product(*a, norm=norm, rope_base=BASE, dtype=dtype, impl="triton"))(
      x, w, k_cache, v_cache, index, start)
  want = _product_oracle(x, w, g, 1e-6, k_cache, v_cache, int(index), np.asarray(start), dtype)
  ref = decode_qkv_product_reference(x, w, g, k_cache, v_cache, index, start, 1e-6, BASE, dtype)
  for gv, wv, rv in zip(got, want, ref):
    assert gv.dtype == dtype and gv.shape == rv.shape
    np.testing.assert_allclose(np.asarray(gv, np.float64), wv, **TOL[dtype])
    np.testing.assert_allclose(np.asarray(gv, np.float64), np.asarray(rv, np.float64), **TOL[dtype])
  others = np.arange(s) != min(int(index), s - 1)
  np.testing.assert_array_equal(np.asarray(got[1])[:, others], np.asarray(k_cache)[:, others])
  np.testing.assert_array_equal(np.asarray(got[2])[:, others], np.asarray(v_cache)[:, others])


def test_product_gradients_are_the_references():
  from sparsejax.kernels.decode_qkv import decode_qkv_product
  rng = np.random.default_rng(5)
  x, w = jnp.asarray(rng.standard_normal((1, 32)), jnp.float32), jnp.asarray(rng.standard_normal((32, 96)), jnp.float32)
  g = jnp.asarray(1.0 + 0.2 * rng.standard_normal(32), jnp.float32)
  k_cache, v_cache = (jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32) for _ in range(2))
  start, index = jnp.asarray([1], jnp.int32), jnp.asarray(4, jnp.int32)
  cts = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in [(1, 2, 16), (1, 8, 2, 16), (1, 8, 2, 16)]]
  loss = lambda impl: lambda x, w, g, k, v: sum(jnp.sum(o * c) for o, c in zip(
      decode_qkv_product(x, w, k, v, index, start, norm=(g, 1e-6), rope_base=BASE, dtype=jnp.float32, impl=impl), cts))
  got = jax.jit(jax.grad(loss("triton"), argnums=(0, 1, 2, 3, 4)))(x, w, g, k_cache, v_cache)
  want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2, 3, 4)))(x, w, g, k_cache, v_cache)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args,match", [
    (dict(x=jnp.zeros((1, 16))), r"x \[rows, 16\] and w \[32, ...\] must share d"),
    (dict(x=jnp.zeros((2, 32))), r"one row per cache row \(1\)"),
    (dict(x=jnp.zeros((32,))), "x must have rank 2"),
    (dict(norm=(jnp.ones((16,)), 1e-6)), r"norm's scale must be \[32\]"),
    (dict(w=jnp.zeros((32, 95))), r"3 \* 2 \* 16 = 96"),
    (dict(impl="cuda"), "impl must be one of"),
])
def test_product_bad_inputs_fail_with_clear_errors(args, match):
  from sparsejax.kernels.decode_qkv import decode_qkv_product
  call = dict(x=jnp.zeros((1, 32)), w=jnp.zeros((32, 96)), k_cache=jnp.zeros((1, 8, 2, 16)),
              v_cache=jnp.zeros((1, 8, 2, 16)), index=jnp.asarray(1, jnp.int32), start=jnp.zeros((1,), jnp.int32),
              norm=None, impl="auto")
  call.update(args)
  with pytest.raises((ValueError, TypeError), match=match):
    decode_qkv_product(**call, rope_base=BASE, dtype=jnp.float32)
