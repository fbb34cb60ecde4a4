"""decode_qkv_attention as one Pallas Triton kernel: decode_attention's chunk programs, each taking its head's
query from the qkv product's split-K parts itself.

A decode step ran decode_qkv (one program per (row, head): the parts' sum, RoPE, the cache write) and then
decode_attention's chunks, two kernels in a chain whose fixed costs dominate at one row (experiments/
notes_decode.md). Here program (b, h, c) sums head h's q parts (splits x dh numbers, from L2), rounds and turns
them as decode_qkv does, and runs chunk c's attention. The new token's k and v are summed and turned too, by
every live program: the program whose chunk counts the written slot writes them to the caches (aliased, in
place) and uses them in place of the slot's stale row in its tile; any other tile that loads that slot does
not count it. No program waits on another. Each vector is handled as its two halves, as RoPE pairs
(x_i, x_{i+dh/2}): scores and the chunk's acc are sums over both halves.

Merged by decode_attention.op's merge. Reference: op.py's (decode_qkv's reference, then decode_attention's).
Off the GPU: interpret mode (tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from sparsejax.kernels.decode_attention import triton as attention
from sparsejax.kernels.shared_lowering import shared_lowering

_NEG = -1e30
NUM_WARPS = 2  # decode_attention's


def _kernel(index_ref, start_ref, inv_ref, parts_ref, k_in, v_in, part_ref, stats_ref, k_out, v_out, *, chunk: int,
            slots: int, splits: int, dtype):
  b, hh, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  heads, dh = k_in.shape[2], k_in.shape[3]
  half = dh // 2
  f32 = lambda v: v.astype(jnp.float32)
  index, start = index_ref[0], start_ref[b]
  # decode_qkv's write clamps into the cache (kv_cache.write's dynamic_update_slice); RoPE keeps the position.
  written = jnp.clip(index, 0, slots - 1)
  first = c * chunk  # this program counts slots [first, first + chunk)
  owner = (written >= first) & (written < first + chunk)
  live = (first <= index) & (first + chunk > jnp.minimum(start, index))
  s0 = jnp.minimum(first, slots - chunk)  # the last chunk loads the cache's last `chunk` slots
  angle = (index - start).astype(jnp.float32) * inv_ref[...]  # [half]
  cos, sin = jnp.cos(angle), jnp.sin(angle)

  def total(which, lo):
    cols = pl.ds((which * heads + hh) * dh + lo, half)
    v = parts_ref[0, b, cols]
    for p in range(1, splits):
      v = v + parts_ref[p, b, cols]
    return f32(v.astype(dtype))

  def turned(which):
    x1, x2 = total(which, 0), total(which, half)
    return f32((x1 * cos - x2 * sin).astype(dtype)), f32((x2 * cos + x1 * sin).astype(dtype))

  @pl.when(owner)
  def _write():
    k1, k2 = turned(1)
    k_out[b, written, hh, pl.ds(0, half)] = k1.astype(k_out.dtype)
    k_out[b, written, hh, pl.ds(half, half)] = k2.astype(k_out.dtype)
    v_out[b, written, hh, pl.ds(0, half)] = total(2, 0).astype(v_out.dtype)
    v_out[b, written, hh, pl.ds(half, half)] = total(2, half).astype(v_out.dtype)

  @pl.when(live)
  def _attend():
    rows = pl.ds(s0, chunk)
    # The tile first: its loads depend on nothing below.
    kt1, kt2 = f32(k_in[b, rows, hh, pl.ds(0, half)]), f32(k_in[b, rows, hh, pl.ds(half, half)])  # [chunk, half]
    vt1, vt2 = f32(v_in[b, rows, hh, pl.ds(0, half)]), f32(v_in[b, rows, hh, pl.ds(half, half)])
    scale = dh ** -0.5
    q1, q2 = turned(0)
    as_cached = lambda x: f32(x.astype(k_in.dtype))  # the row as the cache holds it
    k1, k2 = (as_cached(x) for x in turned(1))
    v1, v2 = as_cached(total(2, 0)), as_cached(total(2, half))
    slot = s0 + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    new = slot == written  # the slot's stale row, in this tile, is the new token's
    kt1, kt2 = jnp.where(new, k1[None, :], kt1), jnp.where(new, k2[None, :], kt2)
    vt1, vt2 = jnp.where(new, v1[None, :], vt1), jnp.where(new, v2[None, :], vt2)
    seen = (((slot >= start) & (slot <= index)) | (slot == index)) & (slot >= first)
    score = jnp.sum(kt1 * (q1 * scale)[None, :], axis=1, keepdims=True) + jnp.sum(kt2 * (q2 * scale)[None, :], axis=1,
                                                                                  keepdims=True)
    s = jnp.where(seen, score, _NEG)  # [chunk, 1]
    m = jnp.max(s, axis=0, keepdims=True)  # [1, 1]
    p = jnp.exp(s - m)
    part_ref[:, pl.ds(0, half)] = jnp.sum(p * vt1, axis=0, keepdims=True)
    part_ref[:, pl.ds(half, half)] = jnp.sum(p * vt2, axis=0, keepdims=True)
    first_col = jax.lax.broadcasted_iota(jnp.int32, (1, 2), 1) == 0
    stats_ref[...] = jnp.where(first_col, m, jnp.sum(p, axis=0, keepdims=True))  # [1, 2]: (m, l)

  @pl.when(jnp.logical_not(live))
  def _dead():
    part_ref[...] = jnp.zeros(part_ref.shape, jnp.float32)
    first_col = jax.lax.broadcasted_iota(jnp.int32, (1, 2), 1) == 0
    stats_ref[...] = jnp.where(first_col, _NEG, 0.0).astype(jnp.float32)


@shared_lowering("dtype", "num_warps")
def qkv_chunk_attention(
    parts: Float[Array, "splits rows three_h_dh"],
    k_cache: Float[Array, "b s h dh"],
    v_cache: Float[Array, "b s h dh"],
    index: Int[Array, ""],
    start: Int[Array, "b"],
    inv_freq: Float[Array, "half"],
    dtype,
    num_warps: int = NUM_WARPS,
    *,
    interpret: bool,
) -> tuple[Float[Array, "b h c dh"], Float[Array, "b h c 2"], Float[Array, "b s h dh"], Float[Array, "b s h dh"]]:
  """(acc_c, (m_c, l_c), k_cache, v_cache): decode_attention's chunk partials of decode_qkv's query, the caches
  with slot `index` written in place."""
  b, slots, h, dh = k_cache.shape
  chunk = attention.chunk_size(slots)
  chunks = -(-slots // chunk)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
  kernel = functools.partial(_kernel, chunk=chunk, slots=slots, splits=parts.shape[0], dtype=jnp.dtype(dtype))
  return pl.pallas_call(
      kernel,
      grid=(b, h, chunks),
      in_specs=[pl.no_block_spec] * 6,
      out_specs=[pl.BlockSpec((None, None, 1, dh), lambda i, j, c: (i, j, c, 0)),
                 pl.BlockSpec((None, None, 1, 2), lambda i, j, c: (i, j, c, 0)),
                 pl.no_block_spec, pl.no_block_spec],
      out_shape=[jax.ShapeDtypeStruct((b, h, chunks, dh), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, chunks, 2), jnp.float32),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
      input_output_aliases={4: 2, 5: 3},
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_decode_qkv_attention",
  )(jnp.reshape(index, (1,)).astype(jnp.int32), start.astype(jnp.int32), inv_freq, parts, k_cache, v_cache)
