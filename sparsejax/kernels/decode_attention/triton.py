"""decode_attention as a Pallas Triton kernel: the cache split into chunks, one program per (row, head, split).

One query per row reads the whole filled cache once; done by one program per (row, head) it is a
chain of dependent loads on a handful of SMs. So (flash-decoding) program (b, h, s) takes every
`splits`-th chunk of the visible range [min(start, index), index], from the s-th on, and keeps the online
softmax statistics over them: m = max_j s_j, l = sum_j e^(s_j - m), acc = sum_j e^(s_j - m) v_j. With one
split the program writes o = acc / l; with more, op.py merges the splits:
o = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c with M = max_c m_c. A split with no visible chunk
writes m = -1e30, l = 0, acc = 0. Every load is in bounds and unmasked (a cache of fewer than 16 slots is
left to XLA). Reference: reference.py. Off the GPU the kernel runs in Pallas' interpret mode (tests).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from sparsejax.kernels import launch_dependents
from sparsejax.kernels.shared_lowering import shared_lowering

CHUNK = 64
MIN_SLOTS = 16  # the smallest chunk (Triton blocks are powers of two, and tiny caches go to XLA)
# splits = ceil(MIN_PROGRAMS / (rows x heads)), at most one a chunk: at one row a program a chunk, as the kernel
# was; at 32 rows of 16 heads two splits, which (with the loop bounded by the visible chunks) took 6.5% off the
# attention of a chain of medium layers against a program a chunk, and 63% where the cache was 4,096 slots with
# 441 filled: those programs and the merge scaled with the cache, not with what is filled (H200,
# experiments/probe_decode_attention.py, results/decode_attention_{focused,long_cache_b32_*}_H200.log).
MIN_PROGRAMS = 1024
DYNAMIC_LOOP = True
NUM_WARPS = 2
_NEG = -1e30  # a finite -inf: exp(_NEG - m) is 0 and never NaN


@dataclasses.dataclass(frozen=True)
class Config:
  chunk: int  # slots a loop step reads, a power of two <= the cache's slots
  splits: int  # programs per (row, head)
  num_warps: int = 2
  num_stages: int = 1
  dynamic_loop: bool = False  # a loop bounded by the visible chunks; else a static loop of guarded steps


def chunk_size(slots: int, chunk: int = CHUNK) -> int:
  """chunk, or the largest power of two <= slots for a shorter cache (every chunk lies inside it)."""
  return min(chunk, 1 << (slots.bit_length() - 1))


def default_config(b: int, h: int, slots: int) -> Config:
  chunk = chunk_size(slots)
  chunks = -(-slots // chunk)
  return Config(chunk=chunk, splits=max(1, min(chunks, -(-MIN_PROGRAMS // (b * h)))), num_warps=NUM_WARPS,
                dynamic_loop=DYNAMIC_LOOP)


def _kernel(index_ref, start_ref, q_ref, k_ref, v_ref, *out_refs, cfg: Config, slots: int, scale: float):
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  chunk, splits = cfg.chunk, cfg.splits
  index, start = index_ref[0], start_ref[b]
  lo = jnp.minimum(start, index) // chunk  # the first and last chunks holding a visible slot
  count = (index // chunk - lo - split) // splits + 1  # this split's chunks: lo + split + i * splits, i < count
  q = q_ref[b, pl.ds(h, 1), :].astype(jnp.float32) * scale  # [1, dh]
  dh = q.shape[-1]

  def step(i, carry):
    m, l, acc = carry
    first = (lo + split + i * splits) * chunk  # this step's slots: [first, first + chunk)
    # The last chunk may run past the cache: it loads the cache's last `chunk` slots instead (every
    # load in bounds, no masked loads) and counts only those at or past `first`.
    s0 = jnp.minimum(first, slots - chunk)
    slot = s0 + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    seen = (((slot >= start) & (slot <= index)) | (slot == index)) & (slot >= first)
    rows = pl.ds(s0, chunk)
    k = k_ref[b, rows, h, :].astype(jnp.float32)  # [chunk, dh]
    v = v_ref[b, rows, h, :].astype(jnp.float32)
    s = jnp.where(seen, jnp.sum(k * q, axis=1, keepdims=True), _NEG)  # [chunk, 1]
    # Every visible chunk holds a visible slot, so m_new is finite and the first step's alpha is 0.
    m_new = jnp.maximum(m, jnp.max(s, axis=0, keepdims=True))  # [1, 1]
    alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new)
    return m_new, l * alpha + jnp.sum(p, axis=0, keepdims=True), acc * alpha + jnp.sum(p * v, axis=0, keepdims=True)

  init = (jnp.full((1, 1), _NEG, jnp.float32), jnp.zeros((1, 1), jnp.float32), jnp.zeros((1, dh), jnp.float32))
  if cfg.dynamic_loop:
    m, l, acc = jax.lax.fori_loop(0, count, step, init)
  else:
    most = -(-(-(-slots // chunk)) // splits)  # ceil(chunks / splits): a split's most chunks
    m, l, acc = jax.lax.fori_loop(
        0, most, lambda i, c: jax.lax.cond(i < count, lambda c: step(i, c), lambda c: c, c), init)
  if splits == 1:
    (o_ref,) = out_refs
    o_ref[...] = (acc / l).astype(o_ref.dtype)
  else:
    part_ref, stats_ref = out_refs
    part_ref[...] = acc
    first_col = jax.lax.broadcasted_iota(jnp.int32, (1, 2), 1) == 0
    stats_ref[...] = jnp.where(first_col, m, l)  # [1, 2]: (m, l)


@shared_lowering("cfg")
def split_attention(
    q: Float[Array, "b h dh"],
    k_cache: Float[Array, "b s h dh"],
    v_cache: Float[Array, "b s h dh"],
    start: Int[Array, "b"],
    index: Int[Array, ""],
    cfg: Config,
    *,
    interpret: bool,
):
  """One split: o [b, h, dh] in q's dtype. More: per split c, (acc_c [b, h, c, dh], (m_c, l_c) [b, h, c, 2]),
  float32 (see the module doc)."""
  b, slots, h, dh = k_cache.shape
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  if cfg.splits == 1:
    out_specs = pl.BlockSpec((None, 1, dh), lambda i, j, c: (i, j, 0))
    out_shape = jax.ShapeDtypeStruct((b, h, dh), q.dtype)
  else:
    out_specs = [pl.BlockSpec((None, None, 1, dh), lambda i, j, c: (i, j, c, 0)),
                 pl.BlockSpec((None, None, 1, 2), lambda i, j, c: (i, j, c, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, h, cfg.splits, dh), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, cfg.splits, 2), jnp.float32)]
  kernel = functools.partial(_kernel, cfg=cfg, slots=slots, scale=dh ** -0.5)
  return launch_dependents.pallas_call(
      kernel,
      grid=(b, h, cfg.splits),
      in_specs=[pl.no_block_spec] * 5,
      out_specs=out_specs,
      out_shape=out_shape,
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_decode_attention",
  )(jnp.reshape(index, (1,)).astype(jnp.int32), start.astype(jnp.int32), q, k_cache, v_cache)
