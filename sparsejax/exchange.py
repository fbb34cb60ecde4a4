"""The expert-parallel row exchange (inside `shard_map`): each device sends block p of its [P, S, ...]
buffer to peer p and receives, in block s, what peer s sent it.

Two ways, one result:
  dense:  `all_to_all` of the whole static buffer; moves P * S rows per device whatever is real.
  ragged: `ragged_all_to_all` of the first n_p rows of block p only (n_p = the rows really placed
          there; the rest of a block is zeros in both ways), so it moves the real rows. The counts
          travel first, by a dense all-to-all of P integers.
"auto" (the default) takes ragged from RAGGED_FROM_PEERS peers up where XLA has the op, else dense
(resolve_exchange has the measurements).

XLA:CPU has no ragged-all-to-all ("HLO opcode ragged-all-to-all is not supported", jax 0.10.2), so on
the CPU the ragged way runs `ragged_all_to_all_reference`, which computes the op's result from dense
collectives: the same offsets and sizes, so the CPU tests check everything but the wire format.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from sparsejax.mesh import ExpertLayout

EXCHANGES = ("auto", "dense", "ragged")
# Backends whose XLA implements ragged-all-to-all (GPU: NCCL send/recv; TPU: native).
RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")
# "auto" sends only the real rows from this many peers up (a single-stage exchange).
RAGGED_FROM_PEERS = 4


def check_exchange(exchange: str, hierarchical: bool) -> None:
  if exchange not in EXCHANGES:
    raise ValueError(f"exchange must be one of {EXCHANGES}; got {exchange!r}.")
  if exchange == "ragged" and hierarchical:
    raise ValueError("exchange='ragged' is a single-stage exchange; use hierarchical=False or exchange='dense'.")


def resolve_exchange(exchange: str, hierarchical: bool, *, num_peers: int, platform: str) -> str:
  """The exchange to run: `exchange` itself, or for "auto" ragged when the all-to-all is single-stage
  over num_peers >= RAGGED_FROM_PEERS devices of a platform whose XLA has ragged-all-to-all, else dense.

  The dense buffer holds P * S rows a device whatever is real (S = T_local * k by default), so it
  grows with P and the ragged exchange does not. On 2 GPUs dense won: the exchange alone on 2 H200s
  (experiments/results/exchange_h200_x2.log: ragged 0.56-0.71 ms against 0.48-0.64), and the MoE-XS
  training step 3 points of weak scaling. On 4 H100s ragged won: the step from a trained router's
  state 88.0% against dense's 77.6% (results/ep_train_h100_80gb_hbm3_x4_trained_buffers.md), the
  layer 60.3% / 55.1% against 52.9% / 47.0% at top-1 / top-2 (results/expert_parallel_h100_x4_top*.log),
  where on 2 of those GPUs dense led, 70.3% / 62.4% against 66.5% / 60.1%. On the CPU ragged is an
  emulation (dense collectives), so "auto" stays dense there."""
  check_exchange(exchange, hierarchical)
  if exchange != "auto":
    return exchange
  ragged = not hierarchical and num_peers >= RAGGED_FROM_PEERS and platform in RAGGED_PLATFORMS
  return "ragged" if ragged else "dense"


def exchange_platform(layout: ExpertLayout) -> str:
  """The platform of the layout's devices ("cpu", "gpu", "tpu")."""
  return layout.mesh.devices.flat[0].platform


def _axis_name(layout: ExpertLayout):
  axes = layout.expert_axes
  return axes[0] if len(axes) == 1 else axes


def peer_index(layout: ExpertLayout):
  """This device's index in the all-to-all group (inside shard_map): its flattened expert-axes index."""
  return jax.lax.axis_index(_axis_name(layout))


def dense_all_to_all(buf, layout: ExpertLayout, hierarchical: bool):
  """buf[p] goes to peer p; returns out[s] = what peer s sent here. Its own inverse."""
  axes = layout.expert_axes
  if hierarchical and len(axes) == 2:
    outer, inner = axes
    n_outer, n_inner = layout.mesh.shape[outer], layout.mesh.shape[inner]
    b = buf.reshape(n_outer, n_inner, *buf.shape[1:])
    # Stage 1 crosses groups (hosts): one message per group pair, carrying all its devices' rows.
    b = jax.lax.all_to_all(b, outer, 0, 0, tiled=True)
    # Stage 2 stays within a group. Peer index = outer * n_inner + inner, as jax flattens axes.
    b = jax.lax.all_to_all(b, inner, 1, 1, tiled=True)
    return b.reshape(buf.shape)
  return jax.lax.all_to_all(buf, _axis_name(layout), 0, 0, tiled=True)


def ragged_all_to_all_rows(buf, send_sizes: Int[Array, "peers"], recv_sizes: Int[Array, "peers"],
                           layout: ExpertLayout, *, chunks: int = 1, emulate: bool | None = None):
  """out[s, :recv_sizes[s]] = peer s's buf[me, :recv_sizes[s]], zero elsewhere; buf: [P, S, ...].

  Equals `dense_all_to_all` when every block's rows past its send size are zero. send_sizes[p]: rows
  of block p to send; recv_sizes[s]: rows peer s sends here (its send_sizes[me]). emulate: run
  `ragged_all_to_all_reference` (default: only where XLA lacks the op). chunks: each block goes as
  that many updates of ceil(S / chunks) rows (same result; XLA's GPU kernel works per update).
  """
  num_peers, slots = buf.shape[:2]
  me = peer_index(layout)
  blocks = jnp.arange(num_peers, dtype=jnp.int32) * slots
  out = ragged_rows(buf.reshape(num_peers * slots, *buf.shape[2:]), send_sizes, blocks,
                    jnp.full((num_peers,), me * slots, jnp.int32), recv_sizes, num_peers * slots, layout,
                    max_rows=slots, chunks=chunks, emulate=emulate)
  return out.reshape(buf.shape)


def ragged_rows(operand, send_sizes: Int[Array, "peers"], input_offsets: Int[Array, "peers"],
                output_offsets: Int[Array, "peers"], recv_sizes: Int[Array, "peers"], out_rows: int,
                layout: ExpertLayout, *, max_rows: int, chunks: int = 1, emulate: bool | None = None):
  """[out_rows, ...]: the rows peer s sends here, recv_sizes[s] of them, at the offset s chose; zero elsewhere.

  This device sends operand[input_offsets[p] : + send_sizes[p]] to peer p, written there from
  output_offsets[p] on. max_rows: a static bound on every send size (each goes as `chunks` updates
  of ceil(max_rows / chunks) rows). emulate as in ragged_all_to_all_rows.
  """
  width = -(-max_rows // chunks)
  at = jnp.arange(chunks, dtype=jnp.int32) * width  # [chunks]: each update's first row in its window
  part = lambda n: jnp.clip(n.astype(jnp.int32)[:, None] - at, 0, width).reshape(-1)
  spread = lambda offsets: (offsets.astype(jnp.int32)[:, None] + at).reshape(-1)
  if emulate is None:
    emulate = exchange_platform(layout) not in RAGGED_PLATFORMS
  op = ragged_all_to_all_reference if emulate else jax.lax.ragged_all_to_all
  output = jnp.zeros((out_rows, *operand.shape[1:]), operand.dtype)
  return op(operand, output, spread(input_offsets), part(send_sizes), spread(output_offsets), part(recv_sizes),
            axis_name=_axis_name(layout))


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                *, axis_name):
  """`jax.lax.ragged_all_to_all` from dense collectives, for XLA:CPU.

  Update i (of P * m) goes to peer i // m: operand[input_offsets[i] : + send_sizes[i]], written on
  that peer at output_offsets[i]; rows of `output` nobody writes keep their values. Moves P * m
  windows of the operand's full length: for correctness tests, not speed.
  """
  n = operand.shape[0]
  updates = input_offsets.shape[0]
  j = jnp.arange(n, dtype=jnp.int32)
  expand = lambda m: m.reshape(m.shape + (1,) * (operand.ndim - 1))
  windows = jnp.take(operand, input_offsets[:, None] + j, axis=0, mode="fill", fill_value=0)
  windows = jnp.where(expand(j < send_sizes[:, None]), windows, jnp.zeros((), operand.dtype))
  received = jax.lax.all_to_all(windows, axis_name, 0, 0, tiled=True)  # peer s's updates to here
  at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where they are written
  rows = jnp.where(j < recv_sizes[:, None], at[:, None] + j, output.shape[0])
  return output.at[rows.reshape(-1)].set(received.reshape(updates * n, *operand.shape[1:]), mode="drop")
