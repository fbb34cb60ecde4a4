"""decode_qkv_attention: the qkv glue and the attention in one Pallas Triton kernel (interpret mode off the GPU)
against float64 oracles and against decode_qkv then decode_attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.kernels.decode_qkv import decode_qkv
from sparsejax.kernels.decode_qkv_attention import decode_qkv_attention, kernel_fits
from tests.moe_testing import seed_of
from tests.test_decode_attention import _oracle as attention_oracle
from tests.test_decode_qkv import BASE, _oracle as qkv_oracle

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}

# (rows, parts, padded rows, slots, heads, head_dim, start per row, slot). The written slot inside the last
# chunk's overlapping window but owned by the chunk before it (150 slots: the last chunk loads 86-149, counts
# 128-149); in the last chunk; past the end (the write clamps onto the last slot); left-padded rows, one
# whose first chunks hold nothing it sees; a 16-slot cache of one chunk; head_dim 16 (halves of 8).
CASES = {
    "one_row_slot_in_the_overlap": (1, 8, 1, 150, 4, 64, [0], 100),
    "one_row_last_chunk": (1, 8, 1, 150, 2, 64, [0], 140),
    "padded_rows_several_chunks": (3, 5, 16, 200, 2, 32, [0, 70, 130], 170),
    "one_chunk_cache": (2, 3, 2, 16, 3, 16, [0, 4], 9),
    "past_the_end": (2, 2, 16, 40, 2, 32, [0, 6], 45),
}


def _inputs(name, dtype):
  b, splits, rows, s, h, dh, start, index = CASES[name]
  rng = np.random.default_rng(seed_of("decode_qkv_attention", name, str(dtype)))
  parts = jnp.asarray(rng.standard_normal((splits, rows, 3 * h * dh)), jnp.float32)
  k_cache, v_cache = (jnp.asarray(rng.standard_normal((b, s, h, dh)), dtype) for _ in range(2))
  return parts, k_cache, v_cache, jnp.asarray(index, jnp.int32), jnp.asarray(start, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_oracles_and_the_two_kernels(name, dtype):
  """o against the attention oracle of the qkv oracle's query and caches (each rounded to dtype, as the step
  holds them) and against decode_qkv then decode_attention; the caches exactly decode_qkv's kernel's (only slot
  min(index, slots - 1) written, with the same arithmetic)."""
  parts, k_cache, v_cache, index, start = _inputs(name, dtype)
  assert kernel_fits(k_cache.shape[-1], k_cache.shape[1])
  call = lambda impl: jax.jit(lambda *a: decode_qkv_attention(*a, rope_base=BASE, dtype=dtype, impl=impl))
  o, keys, values = call("triton")(parts, k_cache, v_cache, index, start)
  q, k_want, v_want = qkv_oracle(parts, k_cache, v_cache, int(index), np.asarray(start), dtype)
  rnd = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(dtype), np.float64)
  want = attention_oracle(rnd(q), rnd(k_want), rnd(v_want), np.asarray(start), int(index))
  assert o.dtype == dtype and o.shape == q.shape
  np.testing.assert_allclose(np.asarray(o, np.float64), want, **TOL[dtype])
  _, keys1, values1 = jax.jit(lambda *a: decode_qkv(*a, rope_base=BASE, dtype=dtype, impl="triton"))(
      parts, k_cache, v_cache, index, start)
  np.testing.assert_array_equal(np.asarray(keys, np.float32), np.asarray(keys1, np.float32))
  np.testing.assert_array_equal(np.asarray(values, np.float32), np.asarray(values1, np.float32))
  o2, _, _ = call("xla")(parts, k_cache, v_cache, index, start)
  # Both round o to dtype after combining the chunks in their own float32 order: in bf16 an element may then
  # differ by an ulp.
  close = TOL[jnp.float32] if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o2, np.float32), **close)


def test_gradients_equal_the_references():
  parts, k_cache, v_cache, index, start = _inputs("padded_rows_several_chunks", jnp.float32)
  rng = np.random.default_rng(5)
  cts = [jnp.asarray(rng.standard_normal(a.shape), jnp.float32) for a in (jnp.zeros((3, 2, 32)), k_cache, v_cache)]
  loss = lambda impl: lambda p, k, v: sum(jnp.sum(o * c) for o, c in zip(
      decode_qkv_attention(p, k, v, index, start, rope_base=BASE, dtype=jnp.float32, impl=impl), cts))
  got = jax.jit(jax.grad(loss("triton"), argnums=(0, 1, 2)))(parts, k_cache, v_cache)
  want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(parts, k_cache, v_cache)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_where_the_kernel_fits_and_bad_inputs():
  assert kernel_fits(64, 585) and kernel_fits(16, 16)
  assert not kernel_fits(48, 160) and not kernel_fits(8, 160) and not kernel_fits(64, 12)
  parts, k_cache, v_cache, index, start = _inputs("one_chunk_cache", jnp.float32)
  call = lambda **kw: decode_qkv_attention(**{**dict(parts=parts, k_cache=k_cache, v_cache=v_cache, index=index,
                                                     start=start, rope_base=BASE, dtype=jnp.float32), **kw})
  with pytest.raises(ValueError, match="impl must be one of"):
    call(impl="cuda")
  with pytest.raises(ValueError, match=r"one entry per row \(2\)"):
    call(start=jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match=r"parts must be \[splits, rows >= 2"):
    call(parts=parts[:, :, :-1])
  with pytest.raises(ValueError, match="impl='triton' needs head_dim a power of two >= 16 and >= 16 cache slots"):
    call(k_cache=k_cache[:, :12], v_cache=v_cache[:, :12], impl="triton")
