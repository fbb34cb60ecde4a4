"""Where each (token, slot) assignment lands in the expert buffer, and the moves in and out of it.

Dropless and capacity-factor MoE differ in this one step. Both put assignment (t, j) routed to
expert e at row offset[e] + rank, where rank counts the earlier tokens routed to e (token order):
- dropless: offset[e] = sum of the (block-padded) counts of experts before e; nothing is dropped.
- capacity: offset[e] = e * C; assignments with rank >= C are dropped.
Dropped or unassigned pairs get the row `num_rows`, one past the buffer, which reads as zeros.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax.kernels import row_moves


@flax.struct.dataclass
class Placement:
  """rows: [T, k] buffer row of each assignment (num_rows when dropped or unassigned).
  group_sizes: [E] rows expert e owns in the buffer (padded counts in dropless mode, C in capacity mode).
  tokens_per_expert: [E] assignments routed to each expert, before any dropping.
  num_dropped: [] assignments dropped for lack of capacity.
  num_rows: static buffer length.
  """
  rows: Int[Array, "tokens k"]
  group_sizes: Int[Array, "experts"]
  tokens_per_expert: Int[Array, "experts"]
  num_dropped: Int[Array, ""]
  num_rows: int = flax.struct.field(pytree_node=False)


def _round_up(x, multiple):
  return (x + multiple - 1) // multiple * multiple


def rank_within_expert(
    expert_ids: Int[Array, "tokens k"], num_experts: int
) -> tuple[Int[Array, "tokens k"], Int[Array, "experts"]]:
  """rank[t, j] = #{(t', j') before (t, j) in token order with the same expert}; and per-expert counts.

  One stable sort by expert id, O(Tk log Tk), instead of a [Tk, E] one-hot cumsum. Ids outside
  [0, E) are unassigned: they sort last and are not counted.
  """
  flat = expert_ids.reshape(-1)
  valid = (flat >= 0) & (flat < num_experts)
  key = jnp.where(valid, flat, num_experts)
  order = jnp.argsort(key, stable=True)
  counts = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  starts = jnp.cumsum(counts) - counts
  sorted_key = key[order]
  start_of_sorted = jnp.where(sorted_key < num_experts, starts[jnp.minimum(sorted_key, num_experts - 1)], 0)
  rank_sorted = jnp.arange(flat.shape[0], dtype=jnp.int32) - start_of_sorted
  rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
  return rank.reshape(expert_ids.shape), counts


def _ranks(expert_ids, num_experts: int):
  """rank_within_expert by the method that is faster on this backend (both give the same ranks and
  counts): on GPUs the sort-free histogram with histogram_chunk's chunk (3-4x faster than the argsort at up to
  2^16 assignments on an H100; on an H200 0.7-1.45x from 2^15 to 2^21, within the autotuned fusions' run-to-run
  spread, and 3.7x at the top-8 expert-parallel receiver, probe_recv_placement); elsewhere the argsort."""
  if jax.default_backend() == "gpu":
    return rank_within_expert_histogram(expert_ids, num_experts)
  return rank_within_expert(expert_ids, num_experts)


def dropless_num_rows(num_assignments: int, num_experts: int, block_size: int = 1) -> int:
  """Static bound on the padded buffer: sum_e ceil(c_e / b) * b <= (floor(Tk / b) + min(E, Tk)) * b."""
  if block_size == 1:
    return num_assignments
  return (num_assignments // block_size + min(num_experts, num_assignments)) * block_size


@jax.named_scope("placement")
def dropless_placement(
    expert_ids: Int[Array, "tokens k"], num_experts: int, *, block_size: int = 1,
    num_assignments: int | None = None,
) -> Placement:
  """Rows sorted by expert, each expert's rows padded up to a multiple of block_size; none dropped.

  num_assignments: a static bound on the ids in [0, E) that sizes the buffer (default: all T k
  slots). Only a caller that guarantees it may pass one (token rounding's extra column)."""
  rank, counts = _ranks(expert_ids, num_experts)
  return _dropless_from_ranks(expert_ids, rank, counts, num_experts, block_size, num_assignments)


def _dropless_from_ranks(expert_ids, rank, counts, num_experts: int, block_size: int,
                         num_assignments: int | None = None) -> Placement:
  """row = offset[e] + rank, offsets over the block-padded counts; ids outside [0, E) get no row."""
  padded = _round_up(counts, block_size)
  offsets = jnp.cumsum(padded) - padded
  bound = expert_ids.size if num_assignments is None else min(num_assignments, expert_ids.size)
  num_rows = dropless_num_rows(bound, num_experts, block_size)
  valid = (expert_ids >= 0) & (expert_ids < num_experts)
  rows = jnp.where(valid, offsets[jnp.clip(expert_ids, 0, num_experts - 1)] + rank, num_rows)
  return Placement(rows.astype(jnp.int32), padded, counts, jnp.zeros((), jnp.int32), num_rows)


@jax.named_scope("placement")
def capacity_placement(
    expert_ids: Int[Array, "tokens k"], num_experts: int, capacity: int
) -> Placement:
  """Expert e owns rows [e*C, (e+1)*C); its first C assignments in token order fill them, the rest drop."""
  rank, counts = _ranks(expert_ids, num_experts)
  num_rows = num_experts * capacity
  valid = (expert_ids >= 0) & (expert_ids < num_experts)
  kept = valid & (rank < capacity)
  rows = jnp.where(kept, jnp.clip(expert_ids, 0, num_experts - 1) * capacity + rank, num_rows)
  num_dropped = jnp.sum(valid & ~kept).astype(jnp.int32)
  group_sizes = jnp.full((num_experts,), capacity, jnp.int32)
  return Placement(rows.astype(jnp.int32), group_sizes, counts, num_dropped, num_rows)


def source_slots(placement: Placement) -> Int[Array, "rows"]:
  """Inverse of the placement: the flat assignment t * k + j that fills each buffer row (T k for empty rows)."""
  n = placement.rows.size
  src = jnp.full((placement.num_rows,), n, jnp.int32)
  return src.at[placement.rows.reshape(-1)].set(jnp.arange(n, dtype=jnp.int32), mode="drop")


def source_tokens(placement: Placement, num_tokens: int) -> Int[Array, "rows"]:
  """Inverse of the placement: the token that fills each buffer row (num_tokens for empty rows)."""
  return source_slots(placement) // placement.rows.shape[1]


def _take(a, idx):
  """a[idx] along axis 0, zero where idx == len(a) (the "no row" index). A filling gather, not a
  gather from a zero-padded copy: the concatenation would copy all of a first."""
  return jnp.take(a, idx, axis=0, mode="fill", fill_value=0)


# Both moves are gathers in both directions. Each filled buffer row holds exactly one assignment
# (t, j), so the transpose of "buffer[r] = x[t(r)]" is "dx[t] = sum_j dbuffer[rows[t, j]]", a gather
# by rows, and the transpose of the combine's gather is a gather by source slots. Autodiff would
# write both as scatter-adds (atomics on a GPU, ~4 ms of an MoE-XS step on an H100).
@jax.custom_vjp
def _gather_rows(x, src_token, rows):
  # A Pallas kernel on GPUs: XLA's filling gather moves one element a thread, at ~half the bandwidth.
  return row_moves.gather_rows(x, src_token)


def _gather_rows_fwd(x, src_token, rows):
  return _gather_rows(x, src_token, rows), (rows, x.shape[0])


def _gather_rows_bwd(res, dbuf):
  rows, _ = res
  picked = _take(dbuf, rows)  # [T, k, d]; unplaced pairs read zeros
  dx = picked[:, 0] if rows.shape[1] == 1 else jnp.sum(picked.astype(jnp.float32), axis=1).astype(dbuf.dtype)
  return dx, None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


@jax.named_scope("gather_rows")
def gather_rows(
    x: Float[Array, "tokens d"], placement: Placement
) -> Float[Array, "rows d"]:
  """buffer[r] = x[token that fills row r], zero for padding rows. Its gradient is a gather too."""
  return _gather_rows(x, source_tokens(placement, x.shape[0]), placement.rows)


@jax.named_scope("ungather_rows")
def ungather_rows(
    buffer: Float[Array, "rows d"], placement: Placement
) -> Float[Array, "tokens d"]:
  """out[t] = buffer[rows[t, 0]], zero for unplaced t: the inverse move of gather_rows for k = 1.

  Its gradient is gather_rows' move (dbuffer[r] = dout[token filling r], zero for empty rows), a
  gather; autodiff of the indexing writes a scatter-add into a zeroed buffer instead.
  """
  if placement.rows.shape[1] != 1:
    raise ValueError(f"ungather_rows: placement of k = 1 assignments, got k = {placement.rows.shape[1]}")
  src = source_tokens(placement, placement.rows.shape[0])
  return _gather_rows(buffer, placement.rows[:, 0], src[:, None])


def _combine(buffer, rows, weights):
  picked = _take(buffer, rows).astype(jnp.float32)  # [T, k, d]
  return jnp.sum(weights.astype(jnp.float32)[:, :, None] * picked, axis=1)


# out_dtype is the custom_vjp's own output dtype, so the backward receives dy in it: with a bf16
# output that is a bf16 dy, gathered to the buffer rows at half the bytes of the float32 one that
# a cast outside the custom_vjp hands over (XLA keeps that one in float32, its excess precision).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _scatter_rows(buffer, rows, weights, src_slot, out_dtype):
  return _combine(buffer, rows, weights).astype(out_dtype)


def _scatter_rows_fwd(buffer, rows, weights, src_slot, out_dtype):
  return _combine(buffer, rows, weights).astype(out_dtype), (buffer, rows, weights, src_slot)


def _scatter_rows_bwd(out_dtype, res, dy):
  buffer, rows, weights, src_slot = res
  k = rows.shape[1]
  # dy_rows[r] = dy[t] for the (t, j) filling row r; empty rows (src_slot T k, token T) read zeros.
  dy_rows = _take(dy, src_slot // k).astype(jnp.float32)
  # dbuffer[r] = c[t, j] dy[t]; empty rows get c = 0 from the fill too.
  c_row = _take(weights.astype(jnp.float32).reshape(-1), src_slot)
  dbuf = (c_row[:, None] * dy_rows).astype(buffer.dtype)
  # dc[t, j] = <dy[t], buffer[rows[t, j]]> = dc_row[rows[t, j]] with dc_row[r] = <dy_rows[r], buffer[r]>,
  # since each filled row holds exactly one (t, j). Reduced in buffer-row order, it reads the buffer
  # contiguously and reuses dbuf's gather of dy; reduced in token order it was a [T, k, d] gather of
  # buffer rows feeding a row reduction, which XLA:GPU compiles to ~2.4x its bytes. The [T, k] gather
  # of dc_row gives the dropped and unassigned pairs (row num_rows) a zero. Elementwise and summed
  # (no dot: no TF32 anywhere).
  dc_row = jnp.sum(buffer.astype(jnp.float32) * dy_rows, axis=-1)
  dc = _take(dc_row, rows).astype(weights.dtype)
  return dbuf, None, dc, None


_scatter_rows.defvjp(_scatter_rows_fwd, _scatter_rows_bwd)


@jax.named_scope("scatter_rows")
def scatter_rows(
    buffer: Float[Array, "rows d"],
    placement: Placement,
    combine_weights: Float[Array, "tokens k"],
    out_dtype,
) -> Float[Array, "tokens d"]:
  """y[t] = sum_j combine_weights[t, j] * buffer[rows[t, j]] in float32; dropped pairs add zero.

  A gather by rows (not a scatter-add), so the forward pass is deterministic, and so is the backward
  (gathers by source slot, see _scatter_rows_bwd). The weights are used in float32 (bf16 would round
  them to 8 bits), and the k-term sum is elementwise, not a dot, so no backend computes it in TF32.
  """
  src = source_slots(placement)
  return _scatter_rows(buffer, placement.rows, combine_weights, src, jnp.dtype(out_dtype))


# --- Sort-free placement (MegaBlocks' histogram + cumulative sum), the same Placement as above.

# Bound on the in-chunk count's [n / chunk, chunk, chunk] comparison, which XLA:GPU fuses into one reduce: on an
# H200 that reduce ran 4-10x slower per element once its operand reached 2^25 elements, at every chunk measured
# (16-128), and a 128-chunk one of 2^27 took minutes to fail to compile
# (experiments/results/placement_NVIDIA_H200_chunks.md; notes_expert_parallel.md, sixty-first session).
IN_CHUNK_ELEMENTS = 2**24


def histogram_chunk(num_assignments: int) -> int:
  """The chunk rank_within_expert_histogram uses by default: 32, halved down to 8 while n * chunk exceeds
  IN_CHUNK_ELEMENTS. Below that bound chunks 8 to 32 ran within the H200's run-to-run spread of each other.
  Past 2^21 assignments chunk 8 exceeds the bound too (not measured there; a smaller chunk grows the [n/c, E]
  histogram instead)."""
  c = 32
  while c > 8 and num_assignments * c > IN_CHUNK_ELEMENTS:
    c //= 2
  return c


def rank_within_expert_histogram(
    expert_ids: Int[Array, "tokens k"], num_experts: int, *, chunk: int | None = None
) -> tuple[Int[Array, "tokens k"], Int[Array, "experts"]]:
  """rank_within_expert without a sort: the same ranks for every valid id, and the same counts.

  The Tk assignments, in token order, are cut into chunks of `chunk`. With h[c, e] the histogram
  of chunk c, rank(i) = sum_{c' < c(i)} h[c', e_i] (an exclusive cumsum over chunks) plus
  #{j < i in chunk c(i): e_j = e_i} (a [chunk, chunk] comparison). O(Tk (chunk + E)) work in
  elementwise ops and reductions that XLA fuses, no sort and no scatter. Ids outside [0, E) are
  not counted; their rank is unspecified (placements send them to no row). chunk=None takes
  histogram_chunk(Tk).
  """
  flat = expert_ids.reshape(-1)
  n = flat.shape[0]
  c = max(1, min(histogram_chunk(n) if chunk is None else chunk, n))
  num_chunks = -(-n // c)
  valid = (flat >= 0) & (flat < num_experts)
  key = jnp.where(valid, flat, num_experts).astype(jnp.int32)
  key = jnp.pad(key, (0, num_chunks * c - n), constant_values=num_experts).reshape(num_chunks, c)
  experts = jnp.arange(num_experts, dtype=jnp.int32)
  hist = jnp.sum(key[:, :, None] == experts, axis=1, dtype=jnp.int32)  # [chunks, E]
  before = jnp.cumsum(hist, axis=0, dtype=jnp.int32) - hist  # assignments to e in earlier chunks
  counts = before[-1] + hist[-1]
  pos = jnp.arange(c, dtype=jnp.int32)
  earlier_same = (key[:, :, None] == key[:, None, :]) & (pos[None, :] < pos[:, None])[None]
  in_chunk = jnp.sum(earlier_same, axis=2, dtype=jnp.int32)  # [chunks, c]
  prior = jnp.take_along_axis(before, jnp.minimum(key, num_experts - 1), axis=1)
  rank = (prior + in_chunk).reshape(-1)[:n]
  return rank.reshape(expert_ids.shape), counts


@jax.named_scope("placement")
def dropless_placement_histogram(
    expert_ids: Int[Array, "tokens k"], num_experts: int, *, block_size: int = 1, chunk: int | None = None
) -> Placement:
  """dropless_placement with the ranks of rank_within_expert_histogram: an identical Placement."""
  rank, counts = rank_within_expert_histogram(expert_ids, num_experts, chunk=chunk)
  return _dropless_from_ranks(expert_ids, rank, counts, num_experts, block_size)
