"""decode_attention as a Pallas Triton kernel: the cache split into chunks, one program per (row, head, chunk).

One query per row reads the whole filled cache once; done by one program per (row, head) it is a
chain of dependent loads on a handful of SMs. So (flash-decoding) program (b, h, c) takes slots
[c * chunk, (c + 1) * chunk), computes the chunk's softmax statistics m = max_j s_j, l = sum_j e^(s_j - m)
and acc = sum_j e^(s_j - m) v_j over its visible slots, and op.py merges the chunks:
o = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c with M = max_c m_c. Chunks wholly outside the
visible range [min(start, index), index] load nothing and write m = -1e30, l = 0, acc = 0. Every
load is in bounds and unmasked (a cache of fewer than 16 slots is left to XLA).
step_chunk_attention is the same kernel for a whole decode step: it also makes the step's q, k and v
from the qkv projection's split-K parts (their sum, RoPE on q and k) and writes k and v into the
caches, so that no XLA kernel runs between the projection and the attention (the sum and RoPE, and
the two cache writes, were three small kernels a layer).
Reference: reference.py. Off the GPU the kernels run in Pallas' interpret mode (tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from sparsejax import rope

CHUNK = 64
MIN_SLOTS = 16  # the smallest chunk (Triton blocks are powers of two, and tiny caches go to XLA)
_NEG = -1e30  # a finite -inf: exp(_NEG - m) is 0 and never NaN


def chunk_size(slots: int) -> int:
  """CHUNK, or the largest power of two <= slots for a shorter cache (every chunk lies inside it)."""
  return min(CHUNK, 1 << (slots.bit_length() - 1))


def _kernel(index_ref, start_ref, q_ref, k_ref, v_ref, part_ref, stats_ref, *, chunk: int, slots: int,
            scale: float):
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  index, start = index_ref[0], start_ref[b]
  first = c * chunk  # this program's slots: [first, first + chunk)
  live = (first <= index) & (first + chunk > jnp.minimum(start, index))
  # The last chunk may run past the cache: it loads the cache's last `chunk` slots instead (every
  # load in bounds, no masked loads) and counts only those at or past `first`.
  s0 = jnp.minimum(first, slots - chunk)

  @pl.when(live)
  def _():
    slot = s0 + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    seen = (((slot >= start) & (slot <= index)) | (slot == index)) & (slot >= first)
    rows = pl.ds(s0, chunk)
    q = q_ref[b, pl.ds(h, 1), :].astype(jnp.float32) * scale  # [1, dh]
    k = k_ref[b, rows, h, :].astype(jnp.float32)  # [chunk, dh]
    s = jnp.where(seen, jnp.sum(k * q, axis=1, keepdims=True), _NEG)  # [chunk, 1]
    m = jnp.max(s, axis=0, keepdims=True)  # [1, 1]
    p = jnp.exp(s - m)
    v = v_ref[b, rows, h, :].astype(jnp.float32)
    part_ref[...] = jnp.sum(p * v, axis=0, keepdims=True)  # [1, dh]
    first_col = jax.lax.broadcasted_iota(jnp.int32, (1, 2), 1) == 0
    stats_ref[...] = jnp.where(first_col, m, jnp.sum(p, axis=0, keepdims=True))  # [1, 2]: (m, l)

  @pl.when(jnp.logical_not(live))
  def _():
    part_ref[...] = jnp.zeros(part_ref.shape, jnp.float32)
    first_col = jax.lax.broadcasted_iota(jnp.int32, (1, 2), 1) == 0
    stats_ref[...] = jnp.where(first_col, _NEG, 0.0).astype(jnp.float32)


def chunk_attention(
    q: Float[Array, "b h dh"],
    k_cache: Float[Array, "b s h dh"],
    v_cache: Float[Array, "b s h dh"],
    start: Int[Array, "b"],
    index: Int[Array, ""],
    *,
    interpret: bool,
) -> tuple[Float[Array, "b h c dh"], Float[Array, "b h c 2"]]:
  """Per chunk c of the cache: (acc_c [b, h, c, dh], (m_c, l_c) [b, h, c, 2]), float32 (see the module doc)."""
  b, slots, h, dh = k_cache.shape
  chunk = chunk_size(slots)
  chunks = -(-slots // chunk)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=2, num_stages=1)
  kernel = functools.partial(_kernel, chunk=chunk, slots=slots, scale=dh ** -0.5)
  return pl.pallas_call(
      kernel,
      grid=(b, h, chunks),
      in_specs=[pl.no_block_spec] * 5,
      out_specs=[pl.BlockSpec((None, None, 1, dh), lambda i, j, c: (i, j, c, 0)),
                 pl.BlockSpec((None, None, 1, 2), lambda i, j, c: (i, j, c, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, h, chunks, dh), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, chunks, 2), jnp.float32)],
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_decode_attention",
  )(jnp.reshape(index, (1,)).astype(jnp.int32), start.astype(jnp.int32), q, k_cache, v_cache)


def _step_kernel(index_ref, start_ref, inv_freq_ref, parts_ref, k_ref, v_ref, k_out, v_out, part_ref,
                 stats_ref, *, chunk: int, slots: int, scale: float, splits: int, dtype):
  """_kernel's chunk of attention, with the step's q, k and v made here from the projection's parts."""
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  index, start = index_ref[0], start_ref[b]
  half = inv_freq_ref.shape[0]
  first = c * chunk
  live = (first <= index) & (first + chunk > jnp.minimum(start, index))
  s0 = jnp.minimum(first, slots - chunk)
  lo, hi = pl.ds(0, half), pl.ds(half, half)

  def new(j, cols):
    """Row b, head h of q (j = 0), k (1) or v (2), half `cols`: the parts' sum, rounded to dtype."""
    acc = parts_ref[0, b, j, h, cols]
    for p in range(1, splits):  # unrolled: splits need not be a power of two
      acc = acc + parts_ref[p, b, j, h, cols]
    return acc.astype(dtype).astype(jnp.float32)

  angle = (index - start).astype(jnp.float32) * inv_freq_ref[...]  # [half]
  cos, sin = jnp.cos(angle), jnp.sin(angle)

  def rope(j):
    """RoPE of row j's halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), rounded to dtype."""
    x1, x2 = new(j, lo), new(j, hi)
    rnd = lambda a: a.astype(dtype).astype(jnp.float32)
    return rnd(x1 * cos - x2 * sin), rnd(x2 * cos + x1 * sin)

  # The program whose chunk holds the query's slot writes the step's k and v there.
  @pl.when((first <= index) & (index < first + chunk))
  def _():
    k1, k2 = rope(1)
    k_out[b, index, h, lo], k_out[b, index, h, hi] = k1.astype(k_out.dtype), k2.astype(k_out.dtype)
    v_out[b, index, h, lo], v_out[b, index, h, hi] = new(2, lo).astype(v_out.dtype), new(2, hi).astype(v_out.dtype)

  @pl.when(live)
  def _():
    slot = s0 + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    seen = (((slot >= start) & (slot <= index)) | (slot == index)) & (slot >= first)
    rows = pl.ds(s0, chunk)
    q1, q2 = rope(0)
    k1, k2 = rope(1)
    # The cache's slot `index` may not hold the step's k and v yet (its writer is another program,
    # or this one, unordered with these loads): take them from registers there.
    fresh = slot == index
    key = lambda cols, new_half: jnp.where(fresh, new_half[None, :], k_ref[b, rows, h, cols].astype(jnp.float32))
    s = jnp.sum(key(lo, k1) * (q1 * scale)[None, :], axis=1, keepdims=True)
    s = s + jnp.sum(key(hi, k2) * (q2 * scale)[None, :], axis=1, keepdims=True)
    s = jnp.where(seen, s, _NEG)  # [chunk, 1]
    m = jnp.max(s, axis=0, keepdims=True)
    p = jnp.exp(s - m)
    val = lambda cols: jnp.where(fresh, new(2, cols)[None, :], v_ref[b, rows, h, cols].astype(jnp.float32))
    part_ref[:, lo] = jnp.sum(p * val(lo), axis=0, keepdims=True)
    part_ref[:, hi] = jnp.sum(p * val(hi), axis=0, keepdims=True)
    first_col = jax.lax.broadcasted_iota(jnp.int32, (1, 2), 1) == 0
    stats_ref[...] = jnp.where(first_col, m, jnp.sum(p, axis=0, keepdims=True))

  @pl.when(jnp.logical_not(live))
  def _():
    part_ref[...] = jnp.zeros(part_ref.shape, jnp.float32)
    first_col = jax.lax.broadcasted_iota(jnp.int32, (1, 2), 1) == 0
    stats_ref[...] = jnp.where(first_col, _NEG, 0.0).astype(jnp.float32)


def step_chunk_attention(
    qkv_parts: Float[Array, "splits b 3 h dh"],
    k_cache: Float[Array, "b s h dh"],
    v_cache: Float[Array, "b s h dh"],
    start: Int[Array, "b"],
    index: Int[Array, ""],
    *,
    rope_base: float,
    dtype,
    interpret: bool,
) -> tuple[Float[Array, "b s h dh"], Float[Array, "b s h dh"], Float[Array, "b h c dh"], Float[Array, "b h c 2"]]:
  """chunk_attention of the step's query, made in the kernel from the projection's split-K parts
  (summed, rounded to dtype, RoPE at position index - start[b]); the step's k and v go into slot
  `index` of the caches, which are updated in place (aliased). Returns (k_cache, v_cache, acc, stats)."""
  splits, b = qkv_parts.shape[:2]
  slots, h, dh = k_cache.shape[1:]
  chunk = chunk_size(slots)
  chunks = -(-slots // chunk)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=2, num_stages=1)
  kernel = functools.partial(_step_kernel, chunk=chunk, slots=slots, scale=dh ** -0.5, splits=splits,
                             dtype=jnp.dtype(dtype))
  return pl.pallas_call(
      kernel,
      grid=(b, h, chunks),
      in_specs=[pl.no_block_spec] * 6,
      out_specs=[pl.no_block_spec, pl.no_block_spec,
                 pl.BlockSpec((None, None, 1, dh), lambda i, j, c: (i, j, c, 0)),
                 pl.BlockSpec((None, None, 1, 2), lambda i, j, c: (i, j, c, 0))],
      out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
                 jax.ShapeDtypeStruct((b, h, chunks, dh), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, chunks, 2), jnp.float32)],
      input_output_aliases={4: 0, 5: 1},
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_decode_attention_step",
  )(jnp.reshape(index, (1,)).astype(jnp.int32), start.astype(jnp.int32), rope.inv_freq(dh, rope_base),
    qkv_parts, k_cache, v_cache)
