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


@pytest.mark.parametrize("programs_per_head", [3, 1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_oracle_and_reference(name, dtype, programs_per_head, monkeypatch):
  """Both grids: q, k and v a program each (the default), and one program a (row, head)."""
  from sparsejax.kernels.decode_qkv import triton as qkv_triton
  monkeypatch.setattr(qkv_triton, "PROGRAMS_PER_HEAD", programs_per_head)
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


def test_an_unknown_grid_is_refused(monkeypatch):
  from sparsejax.kernels.decode_qkv import triton as qkv_triton
  monkeypatch.setattr(qkv_triton, "PROGRAMS_PER_HEAD", 2)
  with pytest.raises(ValueError, match="PROGRAMS_PER_HEAD must be 1 or 3"):
    decode_qkv(jnp.zeros((2, 1, 96)), jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 2, 16)), jnp.asarray(1, jnp.int32),
               jnp.zeros((1,), jnp.int32), rope_base=BASE, dtype=jnp.float32, impl="triton")
