"""decode_attention as a Pallas Triton kernel: the cache split into chunks, one program per (row, head, chunk).

One query per row reads the whole filled cache once; done by one program per (row, head) it is a
chain of dependent loads on a handful of SMs. So (flash-decoding) program (b, h, c) takes slots
[c * chunk, (c + 1) * chunk), computes the chunk's softmax statistics m = max_j s_j, l = sum_j e^(s_j - m)
and acc = sum_j e^(s_j - m) v_j over its visible slots, and op.py merges the chunks:
o = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c with M = max_c m_c. Chunks wholly outside the
visible range [min(start, index), index] load nothing and write m = -1e30, l = 0, acc = 0. Every
load is in bounds and unmasked (a cache of fewer than 16 slots is left to XLA).
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


@shared_lowering()
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
  return launch_dependents.pallas_call(
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
