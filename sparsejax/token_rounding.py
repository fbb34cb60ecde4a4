"""Tile-aware token rounding (SonicMoE, Guo et al. 2025): each expert's assignment count made a
multiple of the kernels' row block, so the padded layout holds no padding rows.

The dropless layer pads every expert to whole 128-row blocks. At about two blocks an expert (E64
top-1 at 16K tokens) that is 25% more rows than tokens, and a block holding few real rows costs
about what a full one does (README, "Where the time goes"). Rounding moves each expert's count to a
neighbouring multiple of the block by dropping its least likely assignments or adding the likeliest
tokens that would take it next. It changes which assignments are computed, so a layer that uses it
is no longer the dropless layer: SonicMoE trains with it and evaluates with plain top-k.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from sparsejax import _checks, moe
from sparsejax.kernels import block_rounding
from sparsejax.routing import NO_EXPERT, TokenChoiceRouting
from sparsejax.topology import BLOCK_SIZE

if TYPE_CHECKING:
  from sparsejax.parallel import ExpertParallelStats


def _check_routing(routing) -> None:
  if not isinstance(routing, TokenChoiceRouting):
    raise TypeError(f"routing must be a TokenChoiceRouting (from top_k_routing); got {type(routing).__name__}.")


@jax.named_scope("token_rounding")
def round_to_blocks(routing: TokenChoiceRouting, block_size: int = BLOCK_SIZE, *,
                    axis_name: str | tuple[str, ...] | None = None, impl: str = "auto") -> TokenChoiceRouting:
  """Expert counts c_e of at least b = block_size made multiples of b; returns ids and weights of k + 1 columns.

  With r_e = c_e mod b: an expert with c_e < b or r_e = 0 is left as it is. Otherwise, if r_e >= b/2
  and at least b - r_e tokens have e as their next choice (their likeliest expert outside their
  picks), the b - r_e of them with the highest p[t, e] take e in the extra column, weighted
  p[t, e] * s_t with s_t = sum_j w[t, j] / sum_j p[t, ids[t, j]] (the scale the router gave the
  token's picks: 1 for Switch, 1 / sum of the k for renormalized top-k). Else e's r_e assignments
  of lowest p[t, e] are dropped (id NO_EXPERT, weight 0). Ties go to the lower token. Each token
  gains at most one expert, so the rounded count is sum_e c_e +- less than E * b / 2. The choice
  is discrete (no gradient); the kept and added weights carry the router's gradient.

  axis_name (inside shard_map: a mesh axis, or a tuple of them): every device along it holds its own
  tokens, and the group's tokens, concatenated in axis order, are rounded as one batch. The result on
  each device is its rows of round_to_blocks on that concatenation; the counts c_e are the group's.
  Beyond the local work it costs a psum of 2E counts and an all_gather of each device's first b items of every
  expert in the order its moves take them (the only ones a move can reach), 2 E b ints.

  impl: how the moves are chosen (kernels.block_rounding): "auto" (Pallas Triton kernels on a GPU, sorts in XLA
  ops elsewhere), "triton" or "xla". A kernel's outputs carry no varying-axes type, so a shard_map around the
  kernels needs check_vma=False (as around every Pallas kernel; the expert-parallel layer sets it).
  """
  _check_routing(routing)
  probs, ids, weights = routing.router_probs, routing.expert_ids, routing.combine_weights
  _checks.check_rank("router_probs", probs, 2, "[tokens, experts]")
  _checks.check_rank("expert_ids", ids, 2, "[tokens, k]")
  _checks.check_integer("expert_ids", ids)
  if ids.shape != weights.shape or ids.shape[0] != probs.shape[0]:
    raise ValueError(f"round_to_blocks: expert_ids {ids.shape}, combine_weights {weights.shape} and "
                     f"router_probs {probs.shape} must agree on [tokens, k] and tokens.")
  if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
    raise ValueError(f"round_to_blocks: block_size must be a positive int; got {block_size!r}.")
  if impl not in block_rounding.IMPLS:
    raise ValueError(f"round_to_blocks: impl must be one of {block_rounding.IMPLS}; got {impl!r}.")
  if axis_name is not None:  # an unknown name would fail inside psum with a bare AssertionError
    for name in (axis_name if isinstance(axis_name, tuple) else (axis_name,)):
      try:
        jax.lax.axis_size(name)
      except NameError:
        raise ValueError(f"round_to_blocks: axis_name {name!r} is not an axis of the enclosing shard_map "
                         "(or vmap); call it inside one that names it.") from None
  num_tokens, num_experts = probs.shape
  b = block_size
  p = jax.lax.stop_gradient(probs).astype(jnp.float32)

  valid = (ids >= 0) & (ids < num_experts)
  e = jnp.where(valid, ids, num_experts).astype(jnp.int32)  # bucket E: not an assignment
  experts = jnp.arange(num_experts, dtype=jnp.int32)
  # probs are >= 0, so -1 marks an expert the token already holds.
  free = jnp.where(jnp.any(e[:, :, None] == experts, axis=1), -1.0, p)
  nxt = jnp.argmax(free, axis=1).astype(jnp.int32)
  nxt_p = jnp.max(free, axis=1)
  nxt = jnp.where(nxt_p >= 0, nxt, num_experts)
  keep, add = block_rounding.block_moves(p, e, nxt, b, impl=impl, axis_name=axis_name)
  # The picks' probabilities, with their gradient: the scale below.
  picked = jnp.take_along_axis(probs.astype(jnp.float32), jnp.minimum(e, num_experts - 1), axis=1)

  w32 = weights.astype(jnp.float32)
  w_sum = jnp.sum(jnp.where(valid, w32, 0.0), axis=1)
  p_sum = jnp.sum(jnp.where(valid, picked, 0.0), axis=1)
  scale = jnp.where(p_sum > 0, w_sum / jnp.where(p_sum > 0, p_sum, 1.0), 1.0)
  p_next = jnp.take_along_axis(probs.astype(jnp.float32), jnp.minimum(nxt, num_experts - 1)[:, None], axis=1)[:, 0]

  new_ids = jnp.concatenate([jnp.where(keep, ids, NO_EXPERT), jnp.where(add, nxt, NO_EXPERT)[:, None]], axis=1)
  new_w = jnp.concatenate([jnp.where(keep, w32, 0.0), jnp.where(add, p_next * scale, 0.0)[:, None]], axis=1)
  return routing.replace(expert_ids=new_ids.astype(jnp.int32), combine_weights=new_w.astype(weights.dtype))


def max_added(num_experts: int, block_size: int = BLOCK_SIZE) -> int:
  """The most assignments round_to_blocks adds: E * floor(b / 2) (it adds b - r_e only when r_e >= b / 2)."""
  return num_experts * (block_size // 2)


def rounded_moe_mlp(
    x: Float[Array, "tokens d_model"],
    routing: TokenChoiceRouting,
    w_in: Float[Array, "experts d_model d_ff"],
    w_out: Float[Array, "experts d_ff d_model"],
    *,
    w_gate: Float[Array, "experts d_model d_ff"] | None = None,
    activation: Callable = jax.nn.gelu,
    impl: str = "auto",
    precision=None,
    mesh=None,
    parallel=None,
) -> tuple[Float[Array, "tokens d_model"], "moe.MoEStats | ExpertParallelStats"]:
  """moe_mlp on round_to_blocks(routing, 128): no padding rows, at the cost of moving assignments.

  The padded buffer is sized for the T k + E * 64 assignments rounding can leave, not for its T (k + 1)
  slots (an extra column of mostly empty slots cost E64 top-1's layer 7% on an H200). stats count
  the experts' rounded rows; num_dropped and dropped_fraction are the assignments rounding dropped.

  mesh (and parallel, an ExpertParallelConfig): the expert-parallel layer (`expert_parallel_moe_mlp`)
  on the rounded routing. Rows for an expert come from every device of its exchange group (the
  expert axes, at one coordinate of the data axes), so each token chunk of the group is rounded as one
  batch (round_to_blocks with axis_name): the group's count of every expert is whole blocks, and the
  moved assignments are those round_to_blocks moves on the group's tokens. Returns
  ExpertParallelStats, whose num_dropped adds what the exchange buffer dropped (none by default).
  """
  _check_routing(routing)
  moe.check_moe_args(x, routing.expert_ids, routing.combine_weights, w_in, w_out, w_gate, impl, activation=activation)
  k = routing.expert_ids.shape[1]
  if routing.router_probs.shape != (x.shape[0], w_in.shape[0]):
    raise ValueError(f"routing.router_probs must be [tokens, experts] = {(x.shape[0], w_in.shape[0])}; "
                     f"got {routing.router_probs.shape}.")
  if mesh is not None:
    from sparsejax import parallel as ep  # it imports this module
    return ep.run_expert_parallel(
        x, routing.expert_ids, routing.combine_weights, w_in, w_out, mesh=mesh,
        parallel=ep.ExpertParallelConfig() if parallel is None else parallel, w_gate=w_gate,
        activation=activation, capacity_factor=None, impl=impl, precision=precision,
        router_probs=routing.router_probs)
  if parallel is not None:
    raise ValueError("rounded_moe_mlp: parallel (an ExpertParallelConfig) needs a mesh.")
  rounded = round_to_blocks(routing)
  bound = routing.expert_ids.size + max_added(w_in.shape[0])
  y, stats = moe._moe_mlp(x, rounded.expert_ids, rounded.combine_weights, w_in, w_out, w_gate=w_gate,
                          activation=activation, capacity_factor=None, impl=impl, precision=precision,
                          num_assignments=bound)
  valid = (routing.expert_ids >= 0) & (routing.expert_ids < w_in.shape[0])
  dropped = jnp.sum(valid & (rounded.expert_ids[:, :k] < 0)).astype(jnp.int32)
  total = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
  return y, stats.replace(num_dropped=dropped, dropped_fraction=dropped.astype(jnp.float32) / total)
