"""decode_attention_out as ONE Pallas Triton grid: the attention's chunk programs, then W_o's programs.

At one row the attention is 1 x h x chunks small programs, a chain of dependent loads and reductions on a
few SMs, and the output projection is a one-wave product whose cost is mostly fixed (its ramp, its first
loads' latency; experiments/probe_tma_read.py). Run as separate kernels (and XLA's merge of the chunks in
between) each pays its own. Here the grid's first NA = h x chunks_p programs are decode_attention's
(triton.attend_chunk: acc_c and (m_c, l_c) per chunk; chunks_p rounds the chunk count up to a power of two,
the extra chunks lie past the cache and write m = -1e30, l = 0). The next NB programs each own rk rows by
bn columns of W_o: they load that slab first, while the attention programs run on the idle SMs, then wait
on a counter for every chunk, merge their rk / dh heads (o_h = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c,
rounded to q's dtype, as decode_attention's merge) and write their part of o W_o. The caller sums the
rk-row parts. Measured in experiments/probe_overlap_phases.py: a small phase and W_o's product in one grid
ran in 0.71x the time of their separate kernels.

A program waits only on programs with lower ids, which the GPU starts first (interpret mode runs them in
order), so no grid-wide residency is needed. The counter [arrivals, departures] is zero at a call's start
and the last W_o program to leave sets it back to zero: the caller carries it from call to call.
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
ROWS_PER_PROGRAM = 128  # rk: W_o rows a program holds (skinny_matmul's split at one row: 128 x 64 columns, 16 KB)


def tiles(h: int, dh: int, d: int) -> tuple[int, int] | None:
  """(rk, bn): W_o rows (whole heads, dividing h dh) and columns a program takes, or None."""
  bn = next((c for c in (64, 32, 16) if d % c == 0), None)
  k = h * dh
  rk = next((r for r in (ROWS_PER_PROGRAM, 256, 512) if r % dh == 0 and k % r == 0), dh)
  return None if bn is None else (rk, bn)


def _kernel(index_ref, start_ref, q_ref, k_ref, v_ref, w_ref, epoch_ref, _, y_ref, part_ref, stats_ref, cnt_ref,
            next_ref, *, chunk: int, slots: int, chunks_p: int, rk: int, bn: int, dtype, interpret: bool):
  from jax.experimental.pallas import triton as plt
  h, dh = q_ref.shape[1:]
  na = h * chunks_p
  vid = pl.program_id(0)
  zero = vid * 0  # atomics want traced indices and values
  one = zero + 1
  f32 = lambda v: v.astype(jnp.float32)
  # Triton's scalar atomic is one elected thread's: without a CTA barrier the other threads' stores of the
  # chunk need not be visible when it releases.
  barrier = (lambda: None) if interpret else plt.debug_barrier

  @pl.when(vid < na)
  def _attend():
    hh, c = vid // chunks_p, vid % chunks_p
    attention.attend_chunk(index_ref[0], start_ref[0], q_ref, k_ref, v_ref, part_ref.at[hh, pl.ds(c, 1), :],
                           stats_ref.at[hh, pl.ds(c, 1), :], 0, hh, c, chunk=chunk, slots=slots, scale=dh ** -0.5)
    barrier()
    plt.atomic_add(cnt_ref, (zero,), one)  # acquire-release: the chunk is visible first

  @pl.when(vid == 0)
  def _next_epoch():
    next_ref[0] = epoch_ref[0] + 1

  @pl.when(vid >= na)
  def _project():
    splits = (h * dh) // rk
    j, p = (vid - na) // splits, (vid - na) % splits
    cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
    heads = pl.ds(pl.multiple_of(p * (rk // dh), rk // dh), rk // dh)
    w = w_ref[heads, :, cols]  # [rk / dh, dh, bn], issued before the wait: it depends on nothing the attention computes
    # The counter only grows: call e (the epoch) finds it at e na and waits for (e + 1) na. A difference, so
    # int32's wrap cancels.
    target = epoch_ref[0] * na + na
    cap = zero + (1 if interpret else 2 ** 30)  # interpret: every arrival is already in
    jax.lax.while_loop(lambda s: (s[0] - target < 0) & (s[1] <= cap),
                       lambda s: (plt.atomic_add(cnt_ref, (zero,), zero), s[1] + 1), (zero + target - na, zero))
    # The acquiring atomic invalidates L1 (CCTL.IVALL in its SASS): plain loads see the chunks.
    part = part_ref[heads]  # [rk / dh, chunks_p, dh]
    m, l = stats_ref[heads, :, 0], stats_ref[heads, :, 1]  # [rk / dh, chunks_p]
    e = jnp.exp(m - jnp.max(m, axis=1, keepdims=True))
    o = jnp.sum(e[:, :, None] * part, axis=1) / jnp.sum(e * l, axis=1, keepdims=True)  # [rk / dh, dh]
    o = f32(o.astype(dtype))
    y_ref[p, cols] = jnp.sum(o.reshape(rk)[:, None] * f32(w.astype(dtype)).reshape(rk, bn), axis=0)


@shared_lowering("rk", "bn", "num_warps")
def attention_out_parts(
    q: Float[Array, "1 h dh"],
    k_cache: Float[Array, "1 s h dh"],
    v_cache: Float[Array, "1 s h dh"],
    start: Int[Array, "1"],
    index: Int[Array, ""],
    w_o: Num[Array, "h dh d"],
    counter: Int[Array, "1"],
    epoch: Int[Array, "1"],
    rk: int,
    bn: int,
    num_warps: int = NUM_WARPS,
    *,
    interpret: bool,
) -> tuple[Float[Array, "splits d"], Int[Array, "1"], Int[Array, "1"]]:
  """(parts, counter, epoch + 1): o W_o = sum_p parts[p] for the one row (w_o as [h, dh, d]), float32. The
  counter must be epoch x h x chunks_p (mod 2^32) at the call: what the last call left with the epoch it returned,
  zeros to start."""
  _, slots, h, dh = k_cache.shape
  chunk = attention.chunk_size(slots)
  chunks_p = pl.next_power_of_2(-(-slots // chunk))
  d = w_o.shape[-1]
  na, nb = h * chunks_p, (d // bn) * ((h * dh) // rk)
  kernel = functools.partial(_kernel, chunk=chunk, slots=slots, chunks_p=chunks_p, rk=rk, bn=bn,
                             dtype=jnp.dtype(q.dtype), interpret=interpret)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
  parts, _, _, counter, epoch = pl.pallas_call(
      kernel,
      grid=(na + nb,),
      in_specs=[pl.no_block_spec] * 8,
      out_specs=[pl.no_block_spec] * 5,
      out_shape=[jax.ShapeDtypeStruct(((h * dh) // rk, d), jnp.float32),
                 jax.ShapeDtypeStruct((h, chunks_p, dh), jnp.float32),
                 jax.ShapeDtypeStruct((h, chunks_p, 2), jnp.float32),
                 jax.ShapeDtypeStruct((1,), jnp.int32),
                 jax.ShapeDtypeStruct((1,), jnp.int32)],
      input_output_aliases={7: 3},
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_decode_attention_out",
  )(jnp.reshape(index, (1,)).astype(jnp.int32), start.astype(jnp.int32), q, k_cache, v_cache, w_o,
    epoch.astype(jnp.int32), counter.astype(jnp.int32))
  return parts, counter, epoch
