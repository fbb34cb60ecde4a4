"""decode_qkv as a Pallas Triton kernel: one program per (row, head), the caches written in place.

A decode step's qkv product leaves its split-K partials unsummed (skinny_matmul.split_k_parts). XLA would
then run three small kernels: the sum with q's RoPE, and k's RoPE with each cache's write. Here program
(b, h) sums its head's parts of q, k and v, rounds them to the model's dtype, rotates q and k (each half
of the head a vector of its own, so the pairs (x_i, x_{i+dh/2}) need no shuffle) and writes q and the
cache slot `index` of row b. The caches are aliased to the outputs, so nothing copies them.
Reference: reference.py. Off the GPU the kernel runs in Pallas' interpret mode (tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from sparsejax.kernels.shared_lowering import shared_lowering


def _kernel(index_ref, start_ref, inv_ref, parts_ref, k_in, v_in, q_ref, k_ref, v_ref, *, splits: int, heads: int,
            dh: int, dtype):
  del k_in, v_in  # the same buffers as k_ref and v_ref
  b, h = pl.program_id(0), pl.program_id(1)
  half = dh // 2
  index = index_ref[0]
  # The write clamps into the cache as kv_cache.write's dynamic_update_slice does: the decode loop's
  # steps past the last slot (dropped results) write onto it. Unclamped, they wrote past the buffer
  # on a GPU and corrupted its neighbours. RoPE keeps the unclamped position, as the reference does.
  slot = jnp.clip(index, 0, k_ref.shape[1] - 1)

  def total(which, lo):
    cols = pl.ds((which * heads + h) * dh + lo, half)
    v = parts_ref[0, b, cols]
    for p in range(1, splits):
      v = v + parts_ref[p, b, cols]
    return v.astype(dtype).astype(jnp.float32)

  angle = (index - start_ref[b]).astype(jnp.float32) * inv_ref[...]
  cos, sin = jnp.cos(angle), jnp.sin(angle)

  def rotated(which, out_ref, idx):
    x1, x2 = total(which, 0), total(which, half)
    out_ref[idx + (pl.ds(0, half),)] = (x1 * cos - x2 * sin).astype(dtype).astype(out_ref.dtype)
    out_ref[idx + (pl.ds(half, half),)] = (x2 * cos + x1 * sin).astype(dtype).astype(out_ref.dtype)

  rotated(0, q_ref, (b, h))
  rotated(1, k_ref, (b, slot, h))
  for lo in (0, half):
    v_ref[b, slot, h, pl.ds(lo, half)] = total(2, lo).astype(dtype).astype(v_ref.dtype)


@shared_lowering("dtype")
def decode_qkv(
    parts: Float[Array, "splits rows three_h_dh"],
    k_cache: Float[Array, "b s h dh"],
    v_cache: Float[Array, "b s h dh"],
    index: Int[Array, ""],
    start: Int[Array, "b"],
    inv_freq: Float[Array, "half"],
    dtype,
    *,
    interpret: bool,
) -> tuple[Float[Array, "b h dh"], Float[Array, "b s h dh"], Float[Array, "b s h dh"]]:
  """(q, k_cache, v_cache) of reference.decode_qkv_reference; the caches are updated in place."""
  b, _, heads, dh = k_cache.shape
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=1, num_stages=1)
  kernel = functools.partial(_kernel, splits=parts.shape[0], heads=heads, dh=dh, dtype=jnp.dtype(dtype))
  return pl.pallas_call(
      kernel,
      grid=(b, heads),
      in_specs=[pl.no_block_spec] * 6,
      out_specs=[pl.no_block_spec] * 3,
      out_shape=[jax.ShapeDtypeStruct((b, heads, dh), dtype), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
      input_output_aliases={4: 1, 5: 2},
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_decode_qkv",
  )(jnp.reshape(index, (1,)).astype(jnp.int32), start.astype(jnp.int32), inv_freq, parts, k_cache, v_cache)
