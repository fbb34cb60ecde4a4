"""decode_attention: the split-cache Pallas Triton kernel (interpret mode off the GPU) against a float64 oracle."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.kernels.decode_attention import decode_attention, decode_attention_reference
from sparsejax.kernels.decode_attention import op as attention_op, triton as attention_triton
from sparsejax.inference import kv_cache
from tests.moe_testing import seed_of

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _oracle(q, k, v, start, index):
  """float64 loop over rows and heads: softmax over slots j with start <= j <= index, or j == index."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, s, h, dh = k.shape
  out = np.zeros((b, h, dh))
  for r in range(b):
    seen = [j for j in range(s) if (start[r] <= j <= index) or j == index]
    for hh in range(h):
      logits = np.array([q[r, hh] @ k[r, j, hh] for j in seen]) / np.sqrt(dh)
      p = np.exp(logits - logits.max())
      out[r, hh] = (p / p.sum()) @ v[r, seen, hh]
  return out


def _case(b, s, h, dh, dtype, seed):
  rng = np.random.default_rng(seed)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return draw(b, h, dh), draw(b, s, h, dh), draw(b, s, h, dh)


# (rows, slots, heads, head_dim, start per row, query slot): slots not a multiple of the 64-slot chunk,
# the query in the first, a middle and the last (partial) chunk, left-padded rows, a padding query.
CASES = {
    "first_slot": (1, 64, 2, 32, [0], 0),
    "one_chunk_boundary": (2, 200, 2, 32, [0, 10], 64),
    "several_chunks_padded_rows": (3, 300, 4, 64, [0, 70, 130], 250),
    "last_partial_chunk": (2, 150, 1, 16, [3, 0], 149),
    "short_cache_one_chunk_of_16": (2, 23, 2, 16, [0, 5], 20),
    "padding_query_sees_itself": (2, 128, 2, 32, [0, 100], 90),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_oracle(name, dtype):
  b, s, h, dh, start, index = CASES[name]
  q, k, v = _case(b, s, h, dh, dtype, seed_of(name, str(dtype)))
  start = jnp.asarray(start, jnp.int32)
  got = jax.jit(lambda q, k, v, i: decode_attention(q, k, v, start, i, impl="triton"))(q, k, v, jnp.int32(index))
  assert got.dtype == dtype and got.shape == (b, h, dh)
  want = _oracle(q, k, v, np.asarray(start), index)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, **TOL[dtype])
  ref = jax.jit(decode_attention_reference)(q, k, v, start, jnp.int32(index))
  np.testing.assert_allclose(np.asarray(ref, np.float32), want, **TOL[dtype])



# Kernel configs the default does not pick at these sizes: one split normalizing in the kernel (the many-row
# case), splits sharing chunks strided, several steps of small chunks, and the loop bounded by the visible chunks.
CONFIGS = {
    "one_split": attention_triton.Config(chunk=64, splits=1),
    "one_split_chunks_of_16": attention_triton.Config(chunk=16, splits=1),
    "two_splits_chunks_of_32": attention_triton.Config(chunk=32, splits=2),
    "dynamic_loop_three_splits": attention_triton.Config(chunk=16, splits=3, dynamic_loop=True),
    "dynamic_loop_one_split": attention_triton.Config(chunk=64, splits=1, dynamic_loop=True),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", ["several_chunks_padded_rows", "last_partial_chunk", "padding_query_sees_itself"])
def test_kernel_configs_equal_the_oracle(name, config, dtype):
  b, s, h, dh, start, index = CASES[name]
  q, k, v = _case(b, s, h, dh, dtype, seed_of(name, config, str(dtype)))
  start = jnp.asarray(start, jnp.int32)
  cfg = CONFIGS[config]
  cfg = attention_triton.Config(**{**cfg.__dict__, "chunk": attention_triton.chunk_size(s, cfg.chunk)})
  got = jax.jit(lambda q, k, v, i: attention_op._split_kernel(q, k, v, start, i, cfg))(q, k, v, jnp.int32(index))
  assert got.dtype == dtype and got.shape == (b, h, dh)
  np.testing.assert_allclose(np.asarray(got, np.float32), _oracle(q, k, v, np.asarray(start), index), **TOL[dtype])


def test_default_config_gives_each_row_and_head_enough_splits():
  """Few rows and heads split the cache up to a chunk a program; many take one split, normalized in the kernel."""
  assert attention_triton.default_config(1, 16, 587).splits == 10
  short = attention_triton.default_config(1, 16, 40)
  assert (short.chunk, short.splits) == (32, 2)
  assert attention_triton.default_config(32, 16, 587).splits == 2
  assert attention_triton.default_config(64, 16, 587).splits == 1

def test_reference_matches_the_cache_mask_of_dot_product_attention():
  """The reference's visibility is kv_cache.mask's, so the kernel can replace the masked XLA attention."""
  b, s, h, dh = 3, 40, 2, 16
  q, k, v = _case(b, s, h, dh, jnp.float32, 5)
  start, index = jnp.asarray([0, 7, 30], jnp.int32), jnp.int32(20)
  want = jax.jit(lambda q, k, v, start, index: jax.nn.dot_product_attention(
      q[:, None], k, v, mask=kv_cache.mask(index, start, 1, s))[:, 0])(q, k, v, start, index)
  got = jax.jit(lambda q, k, v, start, index: decode_attention(q, k, v, start, index, impl="triton"))(
      q, k, v, start, index)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_gradients_equal_the_reference():
  b, s, h, dh = 2, 100, 2, 16
  q, k, v = _case(b, s, h, dh, jnp.float32, 6)
  start, index = jnp.asarray([0, 40], jnp.int32), jnp.int32(80)
  g = jnp.asarray(np.random.default_rng(7).standard_normal((b, h, dh)), jnp.float32)
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * g)
  got = jax.jit(jax.grad(loss(lambda q, k, v: decode_attention(q, k, v, start, index, impl="triton")), (0, 1, 2)))(
      q, k, v)
  want = jax.jit(jax.grad(loss(lambda q, k, v: decode_attention_reference(q, k, v, start, index)), (0, 1, 2)))(
      q, k, v)
  for a, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_bad_inputs_fail_with_clear_errors():
  q, k, v = _case(2, 32, 2, 16, jnp.float32, 8)
  start, index = jnp.zeros((2,), jnp.int32), jnp.int32(3)
  with pytest.raises(ValueError, match="impl must be one of"):
    decode_attention(q, k, v, start, index, impl="cudnn")
  with pytest.raises(ValueError, match="q must be"):
    decode_attention(q[:, :1], k, v, start, index)
  with pytest.raises(ValueError, match="must have one shape"):
    decode_attention(q, k, v[:, :8], start, index)
  with pytest.raises(ValueError, match="one entry per row"):
    decode_attention(q, k, v, start[:1], index)
  with pytest.raises(TypeError, match="index must be an integer"):
    decode_attention(q, k, v, start, jnp.float32(3))
  with pytest.raises(ValueError, match="power of two >= 16 and >= 16 cache slots"):
    q2, k2, v2 = _case(1, 8, 1, 24, jnp.float32, 9)
    decode_attention(q2, k2, v2, start[:1], index, impl="triton")
  with pytest.raises(ValueError, match="got head_dim 16, 8 slots"):
    decode_attention(q, k[:, :8], v[:, :8], start, index, impl="triton")
