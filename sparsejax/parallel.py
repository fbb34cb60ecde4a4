"""Expert parallelism: the MoE layer with its experts sharded over devices, inside `jax.shard_map`.

Every device holds its own tokens (sharded over the data and expert axes) and E/P of the experts
(P = devices along the expert axes). One layer call, per device:

  1. place:    sort the local (token, slot) assignments by destination device and expert into a
               [P, S, d] send buffer (S rows reserved for each peer);
  2. exchange: all-to-all the buffer and the per-expert counts, so each device holds the rows for
               its own experts, [P(source), S, d];
  3. compute:  re-sort those rows by local expert and run the same `expert_ffn` (grouped matmul,
               Pallas on GPU) as one device;
  4. return:   the inverse all-to-all, then the usual weighted combine in token order.

That is dispatch="assignments", a row per (token, expert) pair. The default, dispatch="tokens" (DeepEP's):
a row per (token, peer) pair whose peer holds any of the token's experts (S = T_local, in token order),
with the token's local expert ids and weights beside it; the receiver runs steps 3 and the weighted
combine on what it got, and returns one row a token; the sender sums its peers' rows. For top-k it moves
up to min(k, E/P) times fewer rows (E64 top-8 on 2 H200s: 8.52 -> 4.75 ms forward+backward).

The exchange (`sparsejax.exchange`). Dense (the default): an all-to-all of the whole static
[P, S, d] buffer, which runs everywhere but moves P * S rows even when fewer are real. Ragged
(opt-in): the per-peer counts go first, then `ragged_all_to_all` moves only the real rows of each
block, into the same [P, S, d] layout on the receiver. XLA:CPU lacks the ragged op, so there the
ragged way runs a dense emulation of it (tests).

The bound S (dropless mode, a row an assignment; the token dispatch's S = T_local always holds).
A sender can put at most S_worst = T_local * k rows on one peer (all its
assignments), and at most T_local * min(k, E/P) when every token lists k distinct experts, which
routers ensure but `moe_mlp` does not require (a token may list an expert twice, and is then
computed twice). The default buffer is S = T_local * min(k, E/P): where that is below S_worst, a
token's repeated expert is first made one assignment with the repeats' weights summed
(`merge_repeats`; the layer's value is unchanged), so the buffer holds every routing. (It used to
hold only distinct ids and fall back to S_worst by a `lax.cond`, whose two branches' backward
residuals cost the rounded E64 layer 20% on one H200.) `buffer_factor` f chooses
S = ceil(f * T_local * k / P) instead (f = 1 is a perfectly balanced load), which moves less data.
With it every device counts the rows that would not fit (`exchange_overflow`), and if any
device would overflow, the layer falls back to S_worst for that call (a `lax.cond` on a flag all
devices agree on, so the result is still exact) or, with on_overflow="raise", raises. It never drops
silently: the rows the buffer actually used could not hold are counted in num_dropped.

The token dispatch's bound is on the receiver: it may get every token of its P peers, each with up to
min(k, E/P) of its experts, so its expert rows are R_worst = P * T_local * min(k, E/P), P times the mean
T_local * k. Those rows, and the products' activations over them, are what training keeps for the backward
of every layer: xs-moe at top-8 on 4 H200s (32 x 1024 tokens a GPU) asked for 82 GiB of temp memory a GPU
(one GPU: 23 GiB), more than an H100 holds. With `buffer_factor` f the receiver's rows are
R = ceil(f * T_local * k) (`received_rows`), checked before the exchange from the per-peer counts summed
over the group (`received_overflow`), with the same fallback. The fallback is rematerialized
(`jax.checkpoint`): under autodiff a `lax.cond` keeps both branches' residuals, so a fallback kept as is
would cost every layer its worst-case residuals and make the smaller buffer use more memory than none.

Capacity mode (GShard/Switch) is the baseline: each device is a GShard "group": it keeps the first
C = ceil(cf * T_local * k / E) assignments per expert of its own tokens (token order) and drops the
rest; the [E, C, d] buffer is the send buffer. So the result equals `moe_mlp(..., capacity_factor=cf)`
run on each device's token shard separately, concatenated.

Token rounding (`token_rounding.rounded_moe_mlp(..., mesh=...)`, opt-in, not dropless): an expert's
rows come from every device of its exchange group (the expert and slice axes, at one data coordinate),
so each token chunk is rounded over that group (`round_to_blocks(axis_name=...)`): the group's count of
every expert is whole 128-row blocks, and the result equals the single-device rounded layer on the
group's tokens. Each device then sends at most b/2 more rows to an expert (`rounded_slots`).

Hierarchical exchange (SMILE's bi-level all-to-all): with two expert axes (groups, devices per group)
the all-to-all is done as two, first across groups (hosts), then within each group; same result.

Expert slicing (fewer experts than devices, MegaBlocks' weight parallelism): the expert axis of
P = E * M devices is split into ("expert": E, "expert_slice": M); each device holds d_ff / M of one
expert. Rows go to the expert's E-axis peer, are all-gathered over the slice axis, each slice
computes its partial FFN act(x W_in[:, f_m]) W_out[f_m, :] (exact, since act is elementwise over
d_ff), and a reduce-scatter sums the partials and hands each slice device back its own rows.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import flax.struct
import jax
import numpy as np
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from sparsejax import _checks, permute, token_rounding
from sparsejax.exchange import (check_exchange, dense_all_to_all, exchange_platform, ragged_all_to_all_rows,
                                peer_index, ragged_rows, resolve_exchange)
from sparsejax.grouped_matmul import BLOCK_IMPLS, resolve_impl
from sparsejax.kernels import block_rounding
from sparsejax.mesh import DATA, EXPERT, ExpertLayout, expert_layout
from sparsejax.moe import EXPERT_OUT, capacity, check_moe_args, dropped_fraction, expert_ffn
from sparsejax.routing import NO_EXPERT, TokenChoiceRouting
from sparsejax.topology import BLOCK_SIZE
from sparsejax.topology import make_topology

ON_OVERFLOW = ("fallback", "raise")
DISPATCHES = ("auto", "assignments", "tokens")


@dataclasses.dataclass(frozen=True)
class ExpertParallelConfig:
  """Static options of the expert-parallel layer (hashable, so it can sit on an nnx module).

  data_axis: mesh axis (or axes, or None) that shards only tokens.
  expert_axis: mesh axis that shards experts (and tokens); a pair (groups, devices) for two levels.
  hierarchical: with a pair of expert axes, do the all-to-all in two stages (across groups, then
    within); otherwise one all-to-all over both axes.
  buffer_factor: None = T_local * min(k, E/P) rows per peer (enough for distinct ids per token;
    a token's repeated expert is merged into one assignment first; the token dispatch: T_local a
    peer, and a receiver computes up to P * T_local * min(k, E/P) rows, P times the mean);
    f > 0 = f times the mean: ceil(f * T_local * k / P) rows per peer, a row an assignment, or with
    the token dispatch ceil(f * T_local * k) rows a receiver computes. What it saves is mostly
    training memory: the receivers' rows and activations, kept for the backward of every layer.
  on_overflow: what a call whose routing overflows buffer_factor's buffer does: "fallback" reruns
    the exchange with the worst-case buffer T_local * k (the token dispatch: the receivers' safe
    bound; exact, slower for that call, and rematerialized in the backward), "raise" raises at run
    time. With buffer_factor=None nothing overflows.
  exchange: how dropless rows travel: "dense" (all_to_all of the whole buffer), "ragged"
    (ragged_all_to_all of the real rows only; single-stage), "auto" (ragged from 4 peers up on GPUs
    and TPUs, dense below and on the CPU: exchange.resolve_exchange has the measurements).
    Capacity mode always sends its whole [E, C] buffer (dense).
  ragged_chunks: the ragged exchange sends each peer's rows as this many updates (XLA's GPU kernel
    copies the updates in parallel: one update per peer ran 13x slower than 64 on 2 H200s,
    7.39 against 0.59 ms).
  compact_send: how the ragged exchange (named, or resolved from "auto") sends. None (the default)
    or True: the send buffer holds the T_local * k assignments back to back, sorted by peer, and
    the rows come back into it, instead of P blocks of S rows (P times as many rows at the safe S,
    most of them zeros that the exchange never moves but the row moves around it write and read);
    False: the P blocks. The receiving side keeps its [P, S] blocks either way. Same result. On 4
    H100s (xs-moe step) it took the row moves from 3.16 to 2.47 ms a GPU and the step from 37.48 to
    36.79 ms (experiments/results/ep_train_h100_80gb_hbm3_x4_trained_compact.*). True with the dense
    exchange is an error.
  dispatch: what one row of the dropless exchange carries. "assignments": one row per (token, expert)
    pair, combined with the weights back on the token's device (T_local * min(k, E/P) rows a peer at
    most). "tokens": one row per (token, peer) pair whose peer holds any of the token's experts, with
    the token's local expert ids and weights beside it; the peer computes all of them and returns
    their weighted sum, one row (T_local rows a peer at most; DeepEP's dispatch). For k > 1 it moves
    up to min(k, E/P) times fewer rows each way. Same value; in bf16 each peer's partial sum is
    rounded once before the sum over peers (for k = 1 bit for bit the same). "auto" (the default):
    "tokens". On 2 H200s (E64, forward+backward, safe buffers) "tokens" took top-8 from 8.52 to
    4.75 ms, top-1 from 3.44 to 3.06 (experiments/results/expert_parallel_h200_x2*_dispatch.json).
    With a buffer_factor "auto" took "assignments" until the token dispatch could take one; the two
    have not been timed against each other with a buffer_factor (the token dispatch's bound is on a
    receiver's total, so it overflows less often than the per-peer blocks at the same f).
  token_chunks: dropless only: split each device's tokens into this many contiguous chunks, each
    with its own placement, exchange and expert products. The chunks' chains are independent, so
    the scheduler may run one chunk's all-to-all under another's products; each chunk's products
    are smaller. Same result as 1 (each token's rows are computed the same way).
  """
  data_axis: str | tuple[str, ...] | None = DATA
  expert_axis: str | tuple[str, ...] = EXPERT
  hierarchical: bool = False
  buffer_factor: float | None = None
  on_overflow: str = "fallback"
  exchange: str = "auto"
  ragged_chunks: int = 64
  compact_send: bool | None = None
  dispatch: str = "auto"
  token_chunks: int = 1

  def __post_init__(self):
    check_exchange(self.exchange, self.hierarchical)
    _checks.check_positive("ragged_chunks", self.ragged_chunks)
    if not isinstance(self.token_chunks, int) or isinstance(self.token_chunks, bool) or self.token_chunks < 1:
      raise ValueError(f"token_chunks must be a positive int; got {self.token_chunks!r}.")
    if self.on_overflow not in ON_OVERFLOW:
      raise ValueError(f"on_overflow must be one of {ON_OVERFLOW}; got {self.on_overflow!r}.")
    if self.buffer_factor is not None:
      _checks.check_positive("buffer_factor", self.buffer_factor)
    if self.compact_send is True and self.exchange == "dense":
      raise ValueError("compact_send is a form of the ragged exchange: set exchange='ragged' or 'auto' "
                       "(got 'dense').")
    if self.dispatch not in DISPATCHES:
      raise ValueError(f"dispatch must be one of {DISPATCHES}; got {self.dispatch!r}.")
    if self.hierarchical and (isinstance(self.expert_axis, str) or len(self.expert_axis) != 2):
      raise ValueError("hierarchical=True needs expert_axis=(group_axis, device_axis).")

  @property
  def dropless_dispatch(self) -> str:
    """The dispatch "auto" stands for: "tokens"."""
    return "tokens" if self.dispatch == "auto" else self.dispatch


@flax.struct.dataclass
class ExpertParallelStats:
  """MoEStats of the whole (global) batch, plus the exchange's own counter.

  exchange_overflow: assignments that did not fit the first-choice buffer (buffer_factor's, or the
  distinct-ids default; with the token dispatch, a receiver's rows past its bound) in this call, summed
  over devices. Under "fallback" they were still
  computed, by the fallback. dropped_fraction is `moe.dropped_fraction`, as moe_mlp's.
  """
  tokens_per_expert: Int[Array, "experts"]
  num_dropped: Int[Array, ""]
  dropped_fraction: Float[Array, ""]
  exchange_overflow: Int[Array, ""]


# ----------------------------------------------------------------------------------------------
# Small pure pieces of the data path (usable, and tested, outside shard_map).


def worst_slots(tokens_local: int, top_k: int) -> int:
  """S_worst = T_local * k: the most rows one device can route to one peer, whatever the ids."""
  return tokens_local * top_k


def distinct_slots(tokens_local: int, top_k: int, experts_per_peer: int) -> int:
  """T_local * min(k, E/P): the most rows one device routes to one peer when no token lists an
  expert twice."""
  return tokens_local * min(top_k, experts_per_peer)


def buffer_slots(tokens_local: int, top_k: int, num_peers: int, experts_per_peer: int,
                 buffer_factor: float | None) -> int:
  """The first-choice S = min(distinct bound, ceil(f * T_local * k / P)); the distinct bound for f=None."""
  distinct = distinct_slots(tokens_local, top_k, experts_per_peer)
  if buffer_factor is None:
    return distinct
  return max(1, min(distinct, math.ceil(buffer_factor * tokens_local * top_k / num_peers)))


def merge_repeats(expert_ids: Int[Array, "tokens k"], combine_weights: Float[Array, "tokens k"],
                  num_experts: int) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
  """A token's repeated expert as one assignment: sum_j w_j FFN_{e_j}(x) grouped by expert. The first
  column holding e keeps it with the weights of every column holding e summed (in float32); later
  ones, and ids that are no expert, become NO_EXPERT with weight 0. Every token then lists distinct
  experts, which distinct_slots' buffer holds."""
  valid = (expert_ids >= 0) & (expert_ids < num_experts)
  same = (expert_ids[:, :, None] == expert_ids[:, None, :]) & valid[:, None, :]  # [t, j, j']
  k = expert_ids.shape[1]
  first = valid & ~jnp.any(same & jnp.tri(k, k, -1, dtype=bool), axis=2)  # no earlier column holds e
  summed = jnp.sum(jnp.where(same, combine_weights.astype(jnp.float32)[:, None, :], 0.0), axis=2)
  return (jnp.where(first, expert_ids, NO_EXPERT).astype(expert_ids.dtype),
          jnp.where(first, summed, 0.0).astype(combine_weights.dtype))


def received_rows(tokens_received: int, top_k: int, num_peers: int, width: int,
                  buffer_factor: float | None) -> int:
  """The token dispatch's bound on the assignments a receiver computes: all of its received tokens' local
  experts, R_worst = tokens_received * width (width = min(k, E/P)), or min(R_worst, ceil(f * mean)) with a
  buffer_factor f, mean = tokens_received * k / P (the tokens of the exchange group's devices spread evenly
  over the P receivers)."""
  worst = tokens_received * width
  if buffer_factor is None:
    return worst
  return max(1, min(worst, math.ceil(buffer_factor * tokens_received * top_k / num_peers)))


def first_assignments(expert_ids: Int[Array, "rows width"], num_experts: int, bound: int) -> Int[Array, "rows width"]:
  """expert_ids with the valid ids past the first `bound` of them (in row-major order), and the ids that are no
  expert, made NO_EXPERT: a placement sized for `bound` assignments then holds all that is left."""
  valid = (expert_ids >= 0) & (expert_ids < num_experts)
  kept = valid & (jnp.cumsum(valid.reshape(-1), dtype=jnp.int32).reshape(valid.shape) <= bound)
  return jnp.where(kept, expert_ids, NO_EXPERT).astype(expert_ids.dtype)


def received_overflow(expert_ids: Int[Array, "tokens k"], num_experts: int, layout: ExpertLayout,
                      rows: int) -> Int[Array, ""]:
  """Inside shard_map, the token dispatch's overflow: max(A - rows, 0) for A = the assignments this device's
  experts receive from its exchange group (a psum of every sender's per-peer counts), counted once per
  receiver (on its first slice), so that a sum over devices counts each receiver's excess once."""
  per_peer = jnp.sum(_on_peer(expert_ids, num_experts, layout.num_peers), axis=(0, 1), dtype=jnp.int32)
  received = jax.lax.psum(per_peer, exchange_group(layout))[peer_index(layout)]
  first = True if layout.slice_axis is None else jax.lax.axis_index(layout.slice_axis) == 0
  return jnp.where(first, jnp.maximum(received - rows, 0), 0).astype(jnp.int32)


def exchange_overflow(expert_ids: Int[Array, "tokens k"], num_experts: int, num_peers: int,
                      slots: int) -> Int[Array, ""]:
  """sum_p max(rows for peer p - S, 0): the assignments a [P, S] send buffer cannot hold."""
  _, counts = permute.rank_within_expert(expert_ids, num_experts)
  per_peer = counts.reshape(num_peers, -1).sum(axis=1)
  return jnp.sum(jnp.maximum(per_peer - slots, 0)).astype(jnp.int32)


def peer_placement(
    expert_ids: Int[Array, "tokens k"], num_experts: int, num_peers: int, slots: int
) -> tuple[permute.Placement, Int[Array, "peers experts_per_peer"]]:
  """Send-buffer rows: (t, j) routed to expert e on peer p = e // (E/P) lands at p*S + o_e + rank.

  o_e counts the rows of the experts before e on the same peer, rank the earlier tokens routed to e,
  so each peer's S rows hold its experts' rows sorted by expert, then token. Assignments past S are
  overflow (row P*S, read as zeros; counted in num_dropped). Also returns the [P, E/P] counts that
  were actually sent, which the receiver needs to tell its experts' rows apart.
  """
  experts_per_peer = num_experts // num_peers
  rank, counts = permute.rank_within_expert(expert_ids, num_experts)
  per_peer = counts.reshape(num_peers, experts_per_peer)
  ends = jnp.cumsum(per_peer, axis=1)
  starts = (ends - per_peer).reshape(-1)
  valid = (expert_ids >= 0) & (expert_ids < num_experts)
  e = jnp.clip(expert_ids, 0, num_experts - 1)
  pos = starts[e] + rank
  kept = valid & (pos < slots)
  num_rows = num_peers * slots
  rows = jnp.where(kept, (e // experts_per_peer) * slots + pos, num_rows).astype(jnp.int32)
  clipped = jnp.minimum(ends, slots)
  sent = (clipped - jnp.concatenate([jnp.zeros_like(clipped[:, :1]), clipped[:, :-1]], axis=1))
  overflow = jnp.sum(valid & ~kept).astype(jnp.int32)
  placement = permute.Placement(rows, sent.reshape(-1).astype(jnp.int32), counts, overflow, num_rows)
  return placement, sent.astype(jnp.int32)


def _on_peer(expert_ids: Int[Array, "tokens k"], num_experts: int, num_peers: int) -> Bool[Array, "tokens k peers"]:
  """[t, j, p]: t's j-th expert lives on peer p = e // (E/P) (ids that are no expert live nowhere)."""
  valid = (expert_ids >= 0) & (expert_ids < num_experts)
  owner = jnp.where(valid, expert_ids // (num_experts // num_peers), num_peers)
  return owner[:, :, None] == jnp.arange(num_peers)[None, None, :]


def peer_token_placement(
    expert_ids: Int[Array, "tokens k"], num_experts: int, num_peers: int
) -> tuple[permute.Placement, Int[Array, "peers"]]:
  """Send-buffer rows of the token dispatch: (t, p), for each peer p = e // (E/P) holding any of t's
  experts, lands at p*T + (earlier tokens that also go to p); rows [T, P], row P*T where t sends p
  nothing. Also returns the rows each peer gets, [P]."""
  tokens = expert_ids.shape[0]
  hit = jnp.any(_on_peer(expert_ids, num_experts, num_peers), axis=1)  # [T, P]
  rank = jnp.cumsum(hit, axis=0, dtype=jnp.int32) - 1
  rows = jnp.where(hit, jnp.arange(num_peers, dtype=jnp.int32) * tokens + rank, num_peers * tokens)
  sent = jnp.sum(hit, axis=0, dtype=jnp.int32)
  # Its "groups" are the peers: group_sizes and tokens_per_expert both hold the rows each peer gets.
  placement = permute.Placement(rows.astype(jnp.int32), sent, sent, jnp.zeros((), jnp.int32),
                                num_peers * tokens)
  return placement, sent


def peer_local_routing(
    expert_ids: Int[Array, "tokens k"], combine_weights: Float[Array, "tokens k"], num_experts: int,
    num_peers: int
) -> tuple[Int[Array, "tokens peers width"], Float[Array, "tokens peers width"]]:
  """Each (token, peer) pair's experts as that peer sees them: column c holds the c-th of t's experts
  on p (in t's column order) as the local id e - p E/P with its weight, NO_EXPERT and 0 past them;
  width = min(k, E/P). Needs distinct ids a token (merge_repeats), else a peer could hold more."""
  experts_per_peer = num_experts // num_peers
  width = min(expert_ids.shape[1], experts_per_peer)
  mine = _on_peer(expert_ids, num_experts, num_peers)  # [T, k, P]
  column = jnp.cumsum(mine, axis=1, dtype=jnp.int32) - 1
  at = mine[..., None] & (column[..., None] == jnp.arange(width))  # [T, k, P, width]
  local = (expert_ids % experts_per_peer + 1)[:, :, None, None]
  ids = jnp.sum(jnp.where(at, local, 0), axis=1) - 1  # NO_EXPERT = -1 where no column lands
  weights = jnp.sum(jnp.where(at, combine_weights.astype(jnp.float32)[:, :, None, None], 0.0), axis=1)
  return ids.astype(jnp.int32), weights


def compact_send_placement(
    block: permute.Placement, sent_rows: Int[Array, "peers"], slots: int, num_rows: int | None = None
) -> tuple[permute.Placement, Int[Array, "peers"]]:
  """peer_placement's assignments without the blocks' padding: row p*S + i moves to offsets[p] + i.

  offsets = the exclusive cumsum of sent_rows (the rows each peer gets), so the buffer is the
  T * k assignment slots, peer by peer (num_rows, when a smaller bound on the placed rows holds);
  unsent assignments stay unplaced (row num_rows). Also returns offsets, where each peer's rows start.
  """
  num_peers = sent_rows.shape[0]
  offsets = (jnp.cumsum(sent_rows) - sent_rows).astype(jnp.int32)
  num_rows = block.rows.size if num_rows is None else num_rows
  placed = block.rows < num_peers * slots
  peer = jnp.minimum(block.rows // slots, num_peers - 1)
  rows = jnp.where(placed, offsets[peer] + block.rows % slots, num_rows).astype(jnp.int32)
  return block.replace(rows=rows, num_rows=num_rows), offsets


def received_token_routing(
    meta: Float[Array, "sources slots two_width"], recv_rows: Int[Array, "sources"]
) -> tuple[Int[Array, "rows width"], Float[Array, "rows width"]]:
  """The token dispatch's received routing: row j of source s holds its local ids (as floats) then its weights,
  width = two_width / 2 columns each; rows j >= recv_rows[s] get NO_EXPERT."""
  slots, width = meta.shape[1], meta.shape[2] // 2
  # Past a source's rows the buffer is padding (zeros, or unwritten by a ragged exchange), whose ids
  # would read as local expert 0 and cost it products: no expert.
  real = jnp.arange(slots)[None, :] < recv_rows[:, None]
  ids = jnp.where(real[..., None], meta[..., :width].astype(jnp.int32), NO_EXPERT).reshape(-1, width)
  return ids, meta[..., width:].reshape(-1, width)


def received_expert_ids(
    recv_counts: Int[Array, "sources experts_per_peer"], slots: int
) -> Int[Array, "rows"]:
  """Local expert of each received row: row j of source s is expert l iff ends[s, l-1] <= j < ends[s, l].

  ends = cumsum(recv_counts[s]); rows past a source's total are empty (-1, routing.NO_EXPERT).
  """
  experts_per_peer = recv_counts.shape[1]
  ends = jnp.cumsum(recv_counts, axis=1)
  j = jnp.arange(slots, dtype=ends.dtype)
  # compare_all: no while loop (topology.make_topology says why).
  local = jax.vmap(lambda en: jnp.searchsorted(en, j, side="right", method="compare_all"))(ends)
  return jnp.where(local < experts_per_peer, local, -1).reshape(-1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# The collective steps (inside shard_map).


def _gather_slices(a, layout: ExpertLayout):
  if layout.slice_axis is None:
    return a
  return jax.lax.all_gather(a, layout.slice_axis, axis=0, tiled=True)


def _reduce_slices(a, layout: ExpertLayout):
  # Sums the M partial FFN outputs in the compute dtype (bf16 partials lose a little precision,
  # the price of not moving float32 rows over the slice axis).
  if layout.slice_axis is None:
    return a
  return jax.lax.psum_scatter(a, layout.slice_axis, scatter_dimension=0, tiled=True)


def _ffn(rows, group_sizes, weights, st, topology=None, named=True):
  w_in, w_out, w_gate = weights
  return expert_ffn(rows, group_sizes, w_in, w_out, w_gate=w_gate, activation=st.activation,
                    impl=st.impl, topology=topology, precision=st.precision, named=named)


@dataclasses.dataclass(frozen=True)
class _Static:
  layout: ExpertLayout
  config: ExpertParallelConfig
  num_experts: int
  activation: Callable
  capacity_factor: float | None
  impl: str
  precision: object = None
  exchange: str = "dense"  # resolved: "dense" or "ragged"


def _dropless_local(x, expert_ids, combine_weights, weights, st: _Static, slots: int, received: int | None = None,
                    named: bool = True):
  """One device's dropless layer with a [P, S=slots, d] buffer; returns (y, send placement), whose
  num_dropped counts the assignments the buffer could not hold (and so were not computed). With
  dispatch="tokens" (slots = T_local, distinct ids a token) a row is a (token, peer) pair instead, and
  received (when given) bounds the assignments the receiver computes: the caller has checked that it holds."""
  layout = st.layout
  num_peers, d = layout.num_peers, x.shape[1]
  experts_per_peer = st.num_experts // num_peers
  by_token = st.config.dropless_dispatch == "tokens"
  if by_token:
    send, sent_rows = peer_token_placement(expert_ids, st.num_experts, num_peers)
    local_ids, local_weights = peer_local_routing(expert_ids, combine_weights, st.num_experts, num_peers)
    width = local_ids.shape[2]
    # Ids and weights travel as one float32 array beside the rows (small ints are exact in float32).
    meta = jnp.concatenate([local_ids.astype(jnp.float32), local_weights], axis=2).reshape(-1, 2 * width)
    recv_rows = dense_all_to_all(sent_rows, layout, st.config.hierarchical)
  else:
    send, sent_counts = peer_placement(expert_ids, st.num_experts, num_peers, slots)
    recv_counts = dense_all_to_all(sent_counts, layout, st.config.hierarchical)
    sent_rows, recv_rows = sent_counts.sum(axis=1), recv_counts.sum(axis=1)
  blocked = lambda rows: rows.reshape(num_peers, slots, *rows.shape[1:])

  if st.exchange == "ragged" and st.config.compact_send is not False:
    # A token goes to at most min(k, P) peers: that many rows a token bound the compact buffer.
    bound = x.shape[0] * min(expert_ids.shape[1], num_peers) if by_token else None
    send, offsets = compact_send_placement(send, sent_rows, slots, bound)
    back = dense_all_to_all(offsets, layout, False)  # back[s]: where source s keeps the rows it sent here
    blocks = jnp.arange(num_peers, dtype=jnp.int32) * slots  # block s of a receive buffer: source s's rows
    mine = jnp.full((num_peers,), peer_index(layout) * slots, jnp.int32)  # this device's block on each peer
    ragged = functools.partial(ragged_rows, layout=layout, max_rows=slots, chunks=st.config.ragged_chunks)
    to_peers = lambda rows: blocked(ragged(rows, sent_rows, offsets, mine, recv_rows, num_peers * slots))
    from_peers = lambda buf: ragged(buf.reshape(-1, d), recv_rows, blocks, back, sent_rows, send.num_rows)
  else:
    def exchange(buf, send_sizes, recv_sizes):
      if st.exchange == "ragged":
        return ragged_all_to_all_rows(buf, send_sizes, recv_sizes, layout, chunks=st.config.ragged_chunks)
      return dense_all_to_all(buf, layout, st.config.hierarchical)

    to_peers = lambda rows: exchange(blocked(rows), sent_rows, recv_rows)
    from_peers = lambda buf: exchange(buf, recv_rows, sent_rows)

  x_recv = _gather_slices(to_peers(permute.gather_rows(x, send)), layout)
  block = BLOCK_SIZE if st.impl in BLOCK_IMPLS else 1
  if by_token:
    src = permute.source_slots(send)  # the (t, p) pair that fills each send row
    meta_recv = _gather_slices(to_peers(jnp.take(meta, src, axis=0, mode="fill", fill_value=0)), layout)
    recv_ids, recv_weights = received_token_routing(meta_recv, _gather_slices(recv_rows, layout))
    if received is not None and st.config.on_overflow == "raise":
      # The call raises, but its products still run: past the bound the placement's rows and block topology
      # would point outside the buffer, which a GPU kernel must not read. (The fallback's cond never gets here.)
      recv_ids = first_assignments(recv_ids, experts_per_peer, received)
  else:
    recv_ids = received_expert_ids(_gather_slices(recv_counts, layout), slots)[:, None]
  local = permute.dropless_placement(recv_ids, experts_per_peer, block_size=block, num_assignments=received)
  rows = permute.gather_rows(x_recv.reshape(-1, d), local)
  # As in moe_mlp: on the Pallas path one block topology serves all three products. Its row blocks
  # past the received rows are skipped by the kernels, so the static bound costs no arithmetic.
  topology = (make_topology(local.group_sizes, local.num_rows, block, local.tokens_per_expert)
              if st.impl in BLOCK_IMPLS else None)
  out = _ffn(rows, local.group_sizes, weights, st, topology, named)
  if by_token:  # each received token's weighted sum over this device's experts
    y_recv = permute.scatter_rows(out, local, recv_weights, x.dtype).reshape(x_recv.shape)
  else:
    y_recv = permute.ungather_rows(out, local).reshape(x_recv.shape)

  # Back the way the rows came: block s (peer s's rows, recv_rows[s] of them) returns to s. Named as the expert
  # outputs (expert_ffn's): what remat="hidden" keeps of the layer, so its backward need not run this exchange again.
  y_send = from_peers(_reduce_slices(y_recv, layout))
  y_send = checkpoint_name(y_send, EXPERT_OUT) if named else y_send
  if by_token:  # the sum over peers of the partial sums (ones derived from rows: they vary as the tokens)
    ones = (send.rows >= 0).astype(jnp.float32)
    return permute.scatter_rows(y_send.reshape(-1, d), send, ones, x.dtype), send
  y = permute.scatter_rows(y_send.reshape(-1, d), send, combine_weights, x.dtype)
  return y, send


def _capacity_local(x, expert_ids, combine_weights, weights, st: _Static):
  """One device's GShard layer: its own [E, C] capacity buffer is the send buffer."""
  layout = st.layout
  num_peers, d = layout.num_peers, x.shape[1]
  experts_per_peer = st.num_experts // num_peers
  c = capacity(x.shape[0], st.num_experts, expert_ids.shape[1], st.capacity_factor)
  send = permute.capacity_placement(expert_ids, st.num_experts, c)
  buf = permute.gather_rows(x, send).reshape(num_peers, experts_per_peer * c, d)
  x_recv = _gather_slices(dense_all_to_all(buf, layout, st.config.hierarchical), layout)
  sources = x_recv.shape[0]
  # [sources, E/P, C, d] -> [E/P, sources * C, d]: every local expert gets sources * C equal rows.
  rows = x_recv.reshape(sources, experts_per_peer, c, d).transpose(1, 0, 2, 3).reshape(-1, d)
  out = _ffn(rows, None, weights, st)
  y_recv = out.reshape(experts_per_peer, sources, c, d).transpose(1, 0, 2, 3).reshape(x_recv.shape)
  y_send = checkpoint_name(dense_all_to_all(_reduce_slices(y_recv, layout), layout, st.config.hierarchical), EXPERT_OUT)
  y = permute.scatter_rows(y_send.reshape(-1, d), send, combine_weights, x.dtype)
  return y, send


def _raise_on_overflow(overflow):
  if int(overflow) > 0:
    raise RuntimeError(
        f"expert-parallel exchange overflow: {int(overflow)} assignments did not fit the buffer set "
        "by buffer_factor. Raise buffer_factor, set it to None, or use "
        "on_overflow='fallback'.")
  return np.zeros((), np.int32)


def exchange_group(layout: ExpertLayout) -> tuple[str, ...]:
  """The axes along which devices send one another rows: the expert axes and the slice axis. The
  devices along them, at one coordinate of the data axes, hold the tokens an expert's rows come from."""
  return layout.expert_axes + (() if layout.slice_axis is None else (layout.slice_axis,))


def rounded_slots(tokens_local: int, top_k: int, experts_per_peer: int, slots: int) -> int:
  """A peer's rows after token rounding, from the S = slots it could get before: each token gains at
  most one distinct expert, and a device adds at most b/2 rows to an expert (b = BLOCK_SIZE)."""
  added = min(tokens_local, experts_per_peer * (BLOCK_SIZE // 2))
  return min(distinct_slots(tokens_local, top_k + 1, experts_per_peer), slots + added)


def _local_layer(x, expert_ids, combine_weights, w_in, w_out, w_gate, router_probs, *, st: _Static):
  """The per-device body of shard_map: local tokens and local experts in, local tokens out. With
  router_probs, each token chunk's routing is first rounded to whole blocks over the exchange group."""
  layout, cfg = st.layout, st.config
  all_axes = tuple(layout.mesh.axis_names)
  weights = (w_in, w_out, w_gate)
  overflow = 0
  if st.capacity_factor is not None:
    y, send = _capacity_local(x, expert_ids, combine_weights, weights, st)
    dropped = send.num_dropped
  else:
    chunk = x.shape[0] // cfg.token_chunks
    pieces = lambda a: [a[i * chunk:(i + 1) * chunk] for i in range(cfg.token_chunks)]
    k = expert_ids.shape[1]
    rounded = real_counts = 0
    if router_probs is not None:
      group = exchange_group(layout)
      # round_to_blocks reads no logits: the probabilities stand in for them.
      parts = [token_rounding.round_to_blocks(TokenChoiceRouting(ids, cw, pr, pr), axis_name=group)
               for ids, cw, pr in zip(pieces(expert_ids), pieces(combine_weights), pieces(router_probs))]
      valid = (expert_ids >= 0) & (expert_ids < st.num_experts)
      real_counts = jnp.zeros((st.num_experts + 1,), jnp.int32).at[
          jnp.where(valid, expert_ids, st.num_experts)].add(1)[:st.num_experts]
      expert_ids = jnp.concatenate([r.expert_ids for r in parts])
      combine_weights = jnp.concatenate([r.combine_weights for r in parts])
      rounded = jnp.sum(valid & (expert_ids[:, :k] < 0)).astype(jnp.int32)  # assignments rounding dropped

    def run(slots, expert_ids=expert_ids, combine_weights=combine_weights, received=None, named=True):
      ys, dropped = [], jnp.zeros((), jnp.int32)
      for xc, ids, cw in zip(pieces(x), pieces(expert_ids), pieces(combine_weights)):
        y, send = _dropless_local(xc, ids, cw, weights, st, slots, received, named)
        ys.append(y)
        dropped = dropped + send.num_dropped
      return jnp.concatenate(ys, axis=0) if len(ys) > 1 else ys[0], dropped

    experts_per_peer = st.num_experts // layout.num_peers
    worst = worst_slots(chunk, expert_ids.shape[1])
    slots = buffer_slots(chunk, k, layout.num_peers, experts_per_peer, cfg.buffer_factor)
    if router_probs is not None:
      slots = rounded_slots(chunk, k, experts_per_peer, slots)
    if cfg.dropless_dispatch == "tokens":  # T_local rows a peer always suffice; a receiver's bound may not
      merged = merge_repeats(expert_ids, combine_weights, st.num_experts)
      tokens_received = layout.num_peers * layout.num_slices * chunk
      # Rounded routing has a column more than the router's k: it bounds the worst case, k the mean.
      width = min(merged[0].shape[1], experts_per_peer)
      rows = received_rows(tokens_received, k, layout.num_peers, width, cfg.buffer_factor)
      fallback = first = functools.partial(run, chunk, *merged)
      if rows < received_rows(tokens_received, k, layout.num_peers, width, None):
        first = functools.partial(run, chunk, *merged, received=rows)
        overflow = sum(received_overflow(ids, st.num_experts, layout, rows) for ids in pieces(merged[0]))
    elif slots >= worst:
      first = functools.partial(run, worst)
    elif cfg.buffer_factor is None:  # the distinct-ids bound holds once repeats are merged: no cond
      first = functools.partial(run, slots, *merge_repeats(expert_ids, combine_weights, st.num_experts))
    else:
      first, fallback = functools.partial(run, slots), functools.partial(run, worst)
      overflow = sum(exchange_overflow(ids, st.num_experts, layout.num_peers, slots)
                     for ids in pieces(expert_ids))
    if isinstance(overflow, int):  # the first buffer holds every routing
      y, dropped = first()
    else:
      if cfg.on_overflow == "raise":
        # A pure_callback whose (zero) result feeds y: the error lands on y's buffers (raised when
        # y is read), not on the runtime's effect tokens as a debug.callback's would. Every device
        # raises (so the message repeats P times): with only one, the others would wait forever in
        # the exchange that follows (on the CPU, a fatal rendezvous timeout after 40 s).
        total = jax.lax.stop_gradient(jax.lax.psum(overflow, all_axes))
        zero = jax.pure_callback(_raise_on_overflow, jax.ShapeDtypeStruct((), jnp.int32), total)
        y, dropped = first()
        y = y + zero.astype(y.dtype)
      else:
        # Both branches hold collectives, so every device must take the same one: agree on the flag.
        any_overflow = jax.lax.pmax(overflow, all_axes) > 0
        # The fallback is rematerialized: under autodiff a cond keeps the residuals of both branches for
        # the backward, and the worst-case branch's, saved in every layer, would cost the memory the
        # smaller buffer saves. Remat keeps only its inputs; a call that overflows recomputes it. Its rows go unnamed:
        # under remat="hidden"'s policy, which keeps named rows, the cond kept the worst case's rows in every layer
        # (zeros where the first branch ran), its own checkpoint notwithstanding.
        y, dropped = jax.lax.cond(any_overflow, jax.checkpoint(functools.partial(fallback, named=False)), first)
    dropped = dropped + rounded
  _, counts = permute.rank_within_expert(expert_ids, st.num_experts)
  psum = lambda a: jax.lax.psum(a, st.layout.token_axes)
  out = (y, psum(counts), psum(dropped), psum(jnp.asarray(overflow, jnp.int32)))
  # Rounded, the router's own assignments (dropped_fraction's denominator) are no longer the counts.
  return out if router_probs is None else out + (psum(real_counts),)


def _shard_map(f, mesh, in_specs, out_specs, check=True):
  """jax.shard_map (jax >= 0.7), else the experimental one. check=False turns off the varying-axes
  type check, which pallas_call outputs (no varying-axes annotation) cannot pass."""
  shard_map = getattr(jax, "shard_map", None)
  if shard_map is not None:
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
  from jax.experimental.shard_map import shard_map  # jax < 0.7

  return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


# ----------------------------------------------------------------------------------------------
# Public entry point.


def expert_parallel_moe_mlp(
    x: Float[Array, "tokens d_model"],
    expert_ids: Int[Array, "tokens k"],
    combine_weights: Float[Array, "tokens k"],
    w_in: Float[Array, "experts d_model d_ff"],
    w_out: Float[Array, "experts d_ff d_model"],
    *,
    mesh: Mesh,
    parallel: ExpertParallelConfig = ExpertParallelConfig(),
    w_gate: Float[Array, "experts d_model d_ff"] | None = None,
    activation: Callable = jax.nn.gelu,
    capacity_factor: float | None = None,
    impl: str = "auto",
    precision=None,
) -> tuple[Float[Array, "tokens d_model"], ExpertParallelStats]:
  """y[t] = sum_j combine_weights[t, j] * FFN_{expert_ids[t, j]}(x[t]), experts sharded over mesh.

  Same contract as `moe_mlp` on global arrays. Dropless (capacity_factor=None) it equals `moe_mlp`
  exactly; with a capacity factor it equals `moe_mlp` applied to each device's token shard (GShard's
  per-group capacity C = ceil(cf * T_local * k / E)). Tokens are sharded over (data, expert) axes
  (T divisible by their device count), experts over the expert axes; jit it, and the inputs are
  resharded to that layout if they are not already (see `expert_layout`).
  """
  return run_expert_parallel(x, expert_ids, combine_weights, w_in, w_out, mesh=mesh, parallel=parallel,
                             w_gate=w_gate, activation=activation, capacity_factor=capacity_factor, impl=impl,
                             precision=precision)


def run_expert_parallel(x, expert_ids, combine_weights, w_in, w_out, *, mesh, parallel, w_gate, activation,
                        capacity_factor, impl, precision, router_probs=None):
  """expert_parallel_moe_mlp, and with router_probs ([tokens, experts]) the token-rounded layer of
  `token_rounding.rounded_moe_mlp(..., mesh=...)`, whose one entry point this is."""
  check_moe_args(x, expert_ids, combine_weights, w_in, w_out, w_gate, impl, activation=activation,
                 capacity_factor=capacity_factor)
  if router_probs is not None and capacity_factor is not None:
    raise ValueError("token rounding rounds the dropless layer: capacity_factor must be None.")
  num_experts = w_in.shape[0]
  layout = expert_layout(mesh, num_experts, data_axis=parallel.data_axis,
                         expert_axis=parallel.expert_axis)
  shards = math.prod(layout.mesh.shape[a] for a in layout.token_axes)
  if x.shape[0] % shards:
    raise ValueError(f"{x.shape[0]} tokens do not split over {shards} devices ({layout.token_axes}).")
  if layout.slice_axis is not None and w_in.shape[2] % layout.num_slices:
    raise ValueError(f"d_ff={w_in.shape[2]} does not split into {layout.num_slices} expert slices.")
  if capacity_factor is not None:
    if parallel.token_chunks != 1:
      raise ValueError("token_chunks applies to the dropless layer (capacity_factor=None); a capacity "
                       "layer's groups are whole device shards.")
  elif x.shape[0] // shards % parallel.token_chunks:
    raise ValueError(f"{x.shape[0] // shards} tokens per device do not split into "
                     f"token_chunks={parallel.token_chunks} equal chunks.")
  st = _Static(layout, parallel, num_experts, activation, capacity_factor,
               resolve_impl(impl, jnp.result_type(x, w_in)),
               precision, resolve_exchange(parallel.exchange, parallel.hierarchical, num_peers=layout.num_peers,
                                           platform=exchange_platform(layout)))
  tok = layout.tokens
  in_specs = (tok, tok, tok, layout.w_in(), layout.w_out(), None if w_gate is None else layout.w_in(),
              None if router_probs is None else tok)
  out_specs = (tok, P(), P(), P()) + (() if router_probs is None else (P(),))
  body = lambda *a: _local_layer(*a, st=st)
  # pallas_call's outputs carry no varying-axes type: the check is off wherever a Pallas kernel runs.
  pallas = st.impl in BLOCK_IMPLS or (router_probs is not None and block_rounding.runs_kernel())
  y, tokens_per_expert, num_dropped, overflow, *real = _shard_map(
      body, layout.mesh, in_specs, out_specs, check=not pallas)(
      x, expert_ids, combine_weights, w_in, w_out, w_gate, router_probs)
  real_counts = real[0] if real else tokens_per_expert
  stats = ExpertParallelStats(
      tokens_per_expert=tokens_per_expert,
      num_dropped=num_dropped,
      dropped_fraction=dropped_fraction(num_dropped, real_counts),
      exchange_overflow=overflow,
  )
  return y, stats


def shard_moe_arrays(layout: ExpertLayout, **arrays):
  """device_put each named array to its layout sharding: x/expert_ids/combine_weights on tokens,
  w_in/w_gate/w_out on experts (and d_ff slices). Returns a dict of the same names."""
  specs = {"x": layout.tokens, "expert_ids": layout.tokens, "combine_weights": layout.tokens,
           "w_in": layout.w_in(), "w_gate": layout.w_in(), "w_out": layout.w_out()}
  return {n: jax.device_put(a, layout.sharding(specs[n])) for n, a in arrays.items()}
