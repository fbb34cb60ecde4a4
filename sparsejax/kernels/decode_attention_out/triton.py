"""decode_attention_out as one Pallas Triton kernel with no handoff: program (h, j) attends head h and multiplies.

Program (h, j) loads its W_o slab W_o[h dh : (h + 1) dh, j bn : (j + 1) bn] first, then runs head h's attention
over the whole cache in chunks (an online softmax: m, l and acc carried from chunk to chunk), rounds
o_h = acc / l to q's dtype, as decode_attention does, and writes parts[h, j bn : (j + 1) bn] = o_h W_o slab. The
caller sums the h parts. Every program of head h computes the same o_h: the d / bn column programs read the
head's K and V again, mostly from L2, which is why the op takes this form only for short caches (MAX_SLOTS).

Why no handoff: the one grid of 0725258 / 609b850 (decode_attention's chunk programs, then W_o's programs
waiting on a counter) ran 1.07-1.5x slower than its two kernels on an H100. Its handoff (a release after the
chunk's stores, the waiters' acquire, the merge's loads) and the counter's reset cost ~1.7 us each
(experiments/notes_decode.md, twenty-sixth session). Reading K and V again from L2 costs less than either.
Reference: op.py's (decode_attention's reference, then the product). Off the GPU: interpret mode (tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, Num

from sparsejax.kernels.decode_attention import triton as attention
from sparsejax.kernels.shared_lowering import shared_lowering

NUM_WARPS = 4
MAX_SLOTS = 512  # each column program reads its head's whole cache: at most 128 KB of K and V (head_dim 64, bf16)
_NEG = -1e30


def block_n(h: int, d: int) -> int | None:
  """Output columns a program takes: the widest of 128, 64, 32, 16 dividing d that leaves >= 128 programs
  (h x d / bn, about a wave of an H100's SMs), else the narrowest that divides; None if none does."""
  fits = [c for c in (128, 64, 32, 16) if d % c == 0]
  return next((c for c in fits if h * (d // c) >= 128), fits[-1] if fits else None)


def _kernel(index_ref, start_ref, q_ref, k_ref, v_ref, w_ref, y_ref, *, chunk: int, slots: int, bn: int, dtype):
  hh, j = pl.program_id(0), pl.program_id(1)
  dh = q_ref.shape[-1]
  f32 = lambda v: v.astype(jnp.float32)
  cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
  w = w_ref[hh, :, cols]  # [dh, bn], issued first: it depends on nothing the attention computes
  index, start = index_ref[0], start_ref[0]
  q = f32(q_ref[0, pl.ds(hh, 1), :]) * (dh ** -0.5)  # [1, dh]
  m = jnp.full((1, 1), _NEG, jnp.float32)
  l = jnp.zeros((1, 1), jnp.float32)
  acc = jnp.zeros((1, dh), jnp.float32)
  for c in range(-(-slots // chunk)):  # a few chunks (slots <= MAX_SLOTS), unrolled: their loads issue early
    first = c * chunk
    s0 = min(first, slots - chunk)  # the last chunk loads the cache's last `chunk` slots, counting those >= first
    slot = s0 + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    seen = (((slot >= start) & (slot <= index)) | (slot == index)) & (slot >= first)
    k = f32(k_ref[0, pl.ds(s0, chunk), hh, :])  # [chunk, dh]
    s = jnp.where(seen, jnp.sum(k * q, axis=1, keepdims=True), _NEG)  # [chunk, 1]
    m_new = jnp.maximum(m, jnp.max(s, axis=0, keepdims=True))
    # A chunk with no seen slot ahead of the first seen one adds exp(0) = 1 a slot while m_new is still _NEG;
    # the first seen slot's chunk then scales that by alpha = exp(_NEG - m_new) = 0. Slot `index` is always seen.
    p = jnp.exp(s - m_new)
    alpha = jnp.exp(m - m_new)
    v = f32(v_ref[0, pl.ds(s0, chunk), hh, :])
    acc = acc * alpha + jnp.sum(p * v, axis=0, keepdims=True)
    l = l * alpha + jnp.sum(p, axis=0, keepdims=True)
    m = m_new
  o = f32((acc / l).astype(dtype))  # [1, dh]
  y_ref[pl.ds(hh, 1), cols] = jnp.sum(o.reshape(dh, 1) * f32(w.astype(dtype)), axis=0, keepdims=True)


@shared_lowering("bn", "num_warps")
def attention_out_parts(
    q: Float[Array, "1 h dh"],
    k_cache: Float[Array, "1 s h dh"],
    v_cache: Float[Array, "1 s h dh"],
    start: Int[Array, "1"],
    index: Int[Array, ""],
    w_o: Num[Array, "h dh d"],
    bn: int,
    num_warps: int = NUM_WARPS,
    *,
    interpret: bool,
) -> Float[Array, "h d"]:
  """parts with o W_o = sum_h parts[h] for the one row (w_o as [h, dh, d]), float32."""
  _, slots, h, _ = k_cache.shape
  d = w_o.shape[-1]
  kernel = functools.partial(_kernel, chunk=attention.chunk_size(slots), slots=slots, bn=bn, dtype=jnp.dtype(q.dtype))
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
  return pl.pallas_call(
      kernel,
      grid=(h, d // bn),
      in_specs=[pl.no_block_spec] * 6,
      out_specs=pl.no_block_spec,
      out_shape=jax.ShapeDtypeStruct((h, d), jnp.float32),
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_decode_attention_out",
  )(jnp.reshape(index, (1,)).astype(jnp.int32), start.astype(jnp.int32), q, k_cache, v_cache, w_o)
