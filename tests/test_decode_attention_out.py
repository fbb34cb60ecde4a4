"""decode_attention_out: the attention and W_o in one Pallas Triton kernel (interpret mode off the GPU) against a
float64 oracle and against decode_attention then skinny_matmul."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.kernels.decode_attention_out import decode_attention_out, kernel_fits
from sparsejax.kernels.decode_attention_out import triton as out_triton
from tests.moe_testing import seed_of
from tests.test_decode_attention import _oracle

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _case(s, h, dh, d, dtype, seed):
  rng = np.random.default_rng(seed)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  w_o = jnp.asarray(rng.standard_normal((h * dh, d)) / np.sqrt(h * dh), dtype)
  return draw(1, h, dh), draw(1, s, h, dh), draw(1, s, h, dh), w_o


def _want(q, k, v, start, index, w_o, dtype):
  """float64: o from the attention oracle, rounded to q's dtype (as the layer rounds it), times W_o."""
  o = np.asarray(jnp.asarray(_oracle(q, k, v, np.asarray(start), index), dtype), np.float64)
  return o.reshape(1, -1) @ np.asarray(w_o, np.float64)


# (slots, heads, head_dim, d, start, query slot): 1, 3 and 5 chunks, the last overlapping the one before it;
# 16- to 128-column tiles; left-padded rows, one whose first chunk holds no seen slot; chunks past the query's slot.
CASES = {
    "short_cache_one_chunk_of_16": (23, 2, 16, 48, [0], 20),
    "three_chunks_left_padded": (150, 4, 32, 96, [3], 149),
    "first_chunk_all_padding": (150, 2, 32, 256, [70], 120),
    "medium_heads": (200, 16, 64, 128, [10], 130),
    "five_chunks_query_mid_cache": (300, 2, 64, 64, [0], 70),
    "most_slots_the_kernel_takes": (512, 2, 64, 1024, [0], 511),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_oracle_and_the_two_kernels(name, dtype):
  """The kernel equals the oracle and decode_attention then skinny_matmul ("xla")."""
  s, h, dh, d, start, index = CASES[name]
  q, k, v, w_o = _case(s, h, dh, d, dtype, seed_of("attn_out", name, str(dtype)))
  start = jnp.asarray(start, jnp.int32)
  assert kernel_fits(1, h, dh, s, d)
  want = _want(q, k, v, start, index, w_o, dtype)
  got = jax.jit(lambda *a: decode_attention_out(*a, impl="triton"))(q, k, v, start, jnp.int32(index), w_o)
  assert got.dtype == jnp.float32 and got.shape == (1, d)
  np.testing.assert_allclose(np.asarray(got), want, **TOL[dtype])
  two_calls = decode_attention_out(q, k, v, start, jnp.int32(index), w_o, impl="xla")
  # Both round o to q's dtype after combining the chunks in their own float32 order: in bf16 an element of o may
  # then differ by an ulp, a few 1e-5 of y here.
  close = TOL[jnp.float32] if dtype == jnp.float32 else dict(rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(np.asarray(got), np.asarray(two_calls), **close)


def test_tiles_and_where_the_kernel_fits():
  """A program takes the widest column tile that divides d and leaves >= 128 programs; short caches only."""
  assert out_triton.block_n(16, 1024) == 128  # medium: 16 heads x 8 column blocks
  assert out_triton.block_n(8, 512) == 32 and out_triton.block_n(2, 48) == 16
  assert out_triton.block_n(2, 40) is None  # no column tile for d = 40
  assert kernel_fits(1, 16, 64, 160, 1024) and kernel_fits(1, 16, 64, out_triton.MAX_SLOTS, 1024)
  assert not kernel_fits(1, 16, 64, out_triton.MAX_SLOTS + 1, 1024)  # a longer cache: the two kernels
  assert not kernel_fits(2, 16, 64, 160, 1024)  # one row only
  assert not kernel_fits(1, 16, 48, 160, 768)  # head_dim not a power of two
  assert not kernel_fits(1, 16, 64, 12, 1024)  # a cache under 16 slots goes to XLA


def test_gradients_equal_the_reference():
  s, h, dh, d, start, index = CASES["three_chunks_left_padded"]
  q, k, v, w_o = _case(s, h, dh, d, jnp.float32, 7)
  start = jnp.asarray(start, jnp.int32)
  ct = jnp.asarray(np.random.default_rng(8).standard_normal((1, d)), jnp.float32)
  loss = lambda impl: lambda q, k, v, w: jnp.sum(decode_attention_out(q, k, v, start, jnp.int32(index), w,
                                                                      impl=impl) * ct)
  got = jax.jit(jax.grad(loss("triton"), argnums=(0, 1, 2, 3)))(q, k, v, w_o)
  want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2, 3)))(q, k, v, w_o)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_bad_inputs_fail_with_clear_errors():
  q, k, v, w_o = _case(32, 2, 16, 48, jnp.float32, 9)
  start, index = jnp.zeros((1,), jnp.int32), jnp.int32(5)
  with pytest.raises(ValueError, match=r"w_o must be \[heads \* head_dim = 32, d_model\]"):
    decode_attention_out(q, k, v, start, index, w_o[:16])
  with pytest.raises(TypeError, match="w_o"):
    decode_attention_out(q, k, v, start, index, w_o.astype(jnp.int32))
  with pytest.raises(ValueError, match="impl='triton' takes one row"):
    decode_attention_out(jnp.concatenate([q, q]), jnp.concatenate([k, k]), jnp.concatenate([v, v]),
                         jnp.zeros((2,), jnp.int32), index, w_o, impl="triton")
  with pytest.raises(ValueError, match="impl must be one of"):
    decode_attention_out(q, k, v, start, index, w_o, impl="cuda")
