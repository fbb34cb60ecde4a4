"""decode_qkv as a Pallas Triton kernel: three programs per (row, head), the caches written in place.

A decode step's qkv product leaves its split-K partials unsummed (skinny_matmul.split_k_parts). XLA would
then run three small kernels: the sum with q's RoPE, and k's RoPE with each cache's write. Here program
(b, h, which) sums head h's parts of q, k or v, rounds them to the model's dtype, rotates q and k (each
half of the head a vector of its own, so the pairs (x_i, x_{i+dh/2}) need no shuffle) and writes q or the
cache slot `index` of row b. The caches are aliased to the outputs, so nothing copies them.
Reference: reference.py. Off the GPU the kernel runs in Pallas' interpret mode (tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from sparsejax.kernels import launch_dependents
from sparsejax.kernels.shared_lowering import shared_lowering

# Programs a (row, head): 3 gives q, k and v each its own, 1 takes them in one program. Each program is a short
# chain of dependent latencies; three shorter chains side by side, at 2 warps, took 1.9% off the medium-MoE
# step against one program of 1 warp (one-process A-B on an H100, every round faster;
# experiments/results/decode_qkv_grid_ab_H100.log). 2 warps alone, at one program a head, tied.
PROGRAMS_PER_HEAD = 3
NUM_WARPS = 2


def _kernel(index_ref, start_ref, inv_ref, parts_ref, k_in, v_in, q_ref, k_ref, v_ref, *, splits: int, heads: int,
            dh: int, dtype, split: bool):
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

  def rotated(which, out_ref, idx):
    angle = (index - start_ref[b]).astype(jnp.float32) * inv_ref[...]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = total(which, 0), total(which, half)
    out_ref[idx + (pl.ds(0, half),)] = (x1 * cos - x2 * sin).astype(dtype).astype(out_ref.dtype)
    out_ref[idx + (pl.ds(half, half),)] = (x2 * cos + x1 * sin).astype(dtype).astype(out_ref.dtype)

  def value():
    for lo in (0, half):
      v_ref[b, slot, h, pl.ds(lo, half)] = total(2, lo).astype(dtype).astype(v_ref.dtype)

  if not split:
    rotated(0, q_ref, (b, h))
    rotated(1, k_ref, (b, slot, h))
    value()
    return
  which = pl.program_id(2)
  pl.when(which == 0)(lambda: rotated(0, q_ref, (b, h)))
  pl.when(which == 1)(lambda: rotated(1, k_ref, (b, slot, h)))
  pl.when(which == 2)(value)


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
  """(q, k_cache, v_cache) of reference.decode_qkv_reference; the caches are updated in place. The grid and
  warps are read here, outside the shared lowering, so a changed PROGRAMS_PER_HEAD or NUM_WARPS lowers anew."""
  if PROGRAMS_PER_HEAD not in (1, 3):
    raise ValueError(f"PROGRAMS_PER_HEAD must be 1 or 3; got {PROGRAMS_PER_HEAD}.")
  return _decode_qkv(parts, k_cache, v_cache, index, start, inv_freq, dtype, PROGRAMS_PER_HEAD == 3, NUM_WARPS,
                     interpret=interpret)


@shared_lowering("dtype", "split", "num_warps")
def _decode_qkv(parts, k_cache, v_cache, index, start, inv_freq, dtype, split: bool, num_warps: int, *,
                interpret: bool):
  """decode_qkv's kernel: split gives q, k and v a program each (grid (b, heads, 3)), else (b, heads)."""
  b, _, heads, dh = k_cache.shape
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
  kernel = functools.partial(_kernel, splits=parts.shape[0], heads=heads, dh=dh, dtype=jnp.dtype(dtype), split=split)
  return launch_dependents.pallas_call(
      kernel,
      grid=(b, heads, 3) if split else (b, heads),
      in_specs=[pl.no_block_spec] * 6,
      out_specs=[pl.no_block_spec] * 3,
      out_shape=[jax.ShapeDtypeStruct((b, heads, dh), dtype), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
      input_output_aliases={4: 1, 5: 2},
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_decode_qkv",
  )(jnp.reshape(index, (1,)).astype(jnp.int32), start.astype(jnp.int32), inv_freq, parts, k_cache, v_cache)
