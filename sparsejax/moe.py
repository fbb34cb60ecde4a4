"""The MoE feed-forward layer as a pure function: place, gather, expert FFN, combine."""
from __future__ import annotations

import math
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from sparsejax import _checks, permute
from sparsejax._precision import full_precision
from sparsejax.grouped_matmul import BLOCK_IMPLS, IMPLS, grouped_matmul, kernel_backend, resolve_impl
from sparsejax.routing import ExpertChoiceRouting
from sparsejax.topology import BLOCK_SIZE, Topology, make_topology

# The expert MLP's input rows and output rows, named for rematerialization policies (expert_ffn).
EXPERT_ROWS, EXPERT_OUT = "expert_rows", "expert_out"


@flax.struct.dataclass
class MoEStats:
  """What users log. tokens_per_expert counts assignments before dropping; dropped_fraction is
  `dropped_fraction(num_dropped, tokens_per_expert)`, a fraction of the real assignments."""
  tokens_per_expert: Int[Array, "experts"]
  num_dropped: Int[Array, ""]
  dropped_fraction: Float[Array, ""]


def dropped_fraction(
    num_dropped: Int[Array, ""], tokens_per_expert: Int[Array, "experts"]
) -> Float[Array, ""]:
  """num_dropped / sum_e tokens_per_expert[e]: the share of real assignments (NO_EXPERT slots are
  not assignments) that were dropped; 0 when there are none. The one definition every layer uses."""
  total = jnp.maximum(jnp.sum(tokens_per_expert), 1).astype(jnp.float32)
  return num_dropped.astype(jnp.float32) / total


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
  """C = ceil(capacity_factor * T * k / E): the Switch/GShard slots per expert."""
  _checks.check_positive("capacity_factor", capacity_factor)
  return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def _check_expert_weights(x, w_in, w_out, w_gate):
  _checks.check_rank("x", x, 2, "[tokens, d_model]")
  _checks.check_tokens("x", x)
  _checks.check_floating("x", x)
  _checks.check_rank("w_in", w_in, 3, "[experts, d_model, d_ff]")
  _checks.check_rank("w_out", w_out, 3, "[experts, d_ff, d_model]")
  _checks.check_same_dtype(x=x, w_in=w_in, w_out=w_out, w_gate=w_gate)
  num_experts, d_model, d_ff = w_in.shape
  if x.shape[1] != d_model:
    raise ValueError(f"x has d_model={x.shape[1]} but w_in is [E, {d_model}, {d_ff}].")
  if w_out.shape != (num_experts, d_ff, d_model):
    raise ValueError(f"w_out must be [E, d_ff, d_model] = {(num_experts, d_ff, d_model)}; got {w_out.shape}.")
  if w_gate is not None and w_gate.shape != w_in.shape:
    raise ValueError(f"w_gate must have w_in's shape {w_in.shape}; got {w_gate.shape}.")


def check_moe_args(x, expert_ids, combine_weights, w_in, w_out, w_gate, impl, *, activation,
                   capacity_factor=None) -> None:
  """The argument checks of a token-choice layer (moe_mlp and its expert-parallel twin)."""
  _check_expert_weights(x, w_in, w_out, w_gate)
  _checks.check_activation(activation)
  if capacity_factor is not None:
    _checks.check_positive("capacity_factor", capacity_factor)
  _checks.check_rank("expert_ids", expert_ids, 2, "[tokens, k]")
  _checks.check_integer("expert_ids", expert_ids)
  _checks.check_rank("combine_weights", combine_weights, 2, "[tokens, k]")
  _checks.check_floating("combine_weights", combine_weights)
  if expert_ids.shape != combine_weights.shape:
    raise ValueError(
        f"expert_ids {expert_ids.shape} and combine_weights {combine_weights.shape} must have one shape.")
  if expert_ids.shape[0] != x.shape[0]:
    raise ValueError(f"expert_ids has {expert_ids.shape[0]} tokens but x has {x.shape[0]}.")
  _checks.check_top_k(expert_ids.shape[1], w_in.shape[0])
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")


@jax.named_scope("expert_ffn")
def expert_ffn(
    rows: Float[Array, "rows d_model"],
    group_sizes: Int[Array, "experts"] | None,
    w_in: Float[Array, "experts d_model d_ff"],
    w_out: Float[Array, "experts d_ff d_model"],
    *,
    w_gate: Float[Array, "experts d_model d_ff"] | None = None,
    activation: Callable = jax.nn.gelu,
    impl: str = "auto",
    topology: Topology | None = None,
    precision=None,
    named: bool = True,
) -> Float[Array, "rows d_model"]:
  """FFN_e(r) = act(r W_in[e]) W_out[e], or (act(r W_gate[e]) * r W_in[e]) W_out[e], for rows of group e.

  group_sizes=None means E equal groups (the capacity layout): a batched einsum then does the work.
  A topology (rows already in the block-padded layout) sends all the products to the Pallas
  kernels with one topology, built once, as one `expert_mlp`, whose activation (and GLU product)
  the Hopper kernels fuse. precision: as jax.lax.dot's; None is full float32
  precision for float32 inputs (no TF32 on GPU), the backend default for bf16 (the Pallas kernels
  are always full precision for their input dtype). named=False leaves the rows unnamed for remat policies (a
  region that must keep none of them).
  """
  _checks.check_activation(activation)
  # Named for TransformerConfig.remat="hidden", whose rematerialized region keeps these two and recomputes the
  # rest, so its backward runs the first products again but not the rows' placement, gather or exchange.
  # Outside such a region a name is the identity.
  name = checkpoint_name if named else (lambda a, n: a)
  rows = name(rows, EXPERT_ROWS)
  if topology is not None:
    from sparsejax.kernels import gmm

    backend = kernel_backend(impl) if impl in BLOCK_IMPLS else "auto"
    # One op, so a backend can fuse the activation (and the GLU product) into its kernels.
    return name(gmm.expert_mlp(rows, w_in, w_out, topology, activation=activation, backend=backend, w_gate=w_gate),
                EXPERT_OUT)
  if group_sizes is None:
    num_experts = w_in.shape[0]
    r = rows.reshape(num_experts, -1, rows.shape[-1])
    # A plain einsum: the matmul accumulates in float32 inside, and its backward stays in the
    # input dtype (an f32 preferred_element_type would make the backward run float32 matmuls).
    mm = lambda a, w: jnp.einsum("ecd,edf->ecf", a, w, precision=full_precision(precision, a, w))
  else:
    r = rows
    mm = lambda a, w: grouped_matmul(a, w, group_sizes, impl=impl, precision=precision)
  h = mm(r, w_in)
  if w_gate is not None:
    h = activation(mm(r, w_gate)) * h
  else:
    h = activation(h)
  return name(mm(h, w_out).reshape(rows.shape), EXPERT_OUT)


def moe_mlp(
    x: Float[Array, "tokens d_model"],
    expert_ids: Int[Array, "tokens k"],
    combine_weights: Float[Array, "tokens k"],
    w_in: Float[Array, "experts d_model d_ff"],
    w_out: Float[Array, "experts d_ff d_model"],
    *,
    w_gate: Float[Array, "experts d_model d_ff"] | None = None,
    activation: Callable = jax.nn.gelu,
    capacity_factor: float | None = None,
    impl: str = "auto",
    precision=None,
) -> tuple[Float[Array, "tokens d_model"], MoEStats]:
  """y[t] = sum_j combine_weights[t, j] * FFN_{expert_ids[t, j]}(x[t]); returns (y, MoEStats).

  capacity_factor=None is dropless: every assignment is computed, the expert rows sorted (and, for
  the Pallas kernels, padded to 128-row blocks) by expert. A float gives the Switch/GShard layer:
  C = ceil(capacity_factor * T * k / E) rows per expert, later assignments (token order) dropped
  and counted. Expert ids of -1 (routing.NO_EXPERT), or anywhere outside [0, E), contribute nothing and
  are not counted as dropped (ids are traced values, so an out-of-range one cannot be refused at trace time).
  combine_weights may be float32 with bf16 x: the combine is done in float32 either way.
  precision: see `expert_ffn` (None: full float32 precision for float32 inputs on every backend).
  """
  check_moe_args(x, expert_ids, combine_weights, w_in, w_out, w_gate, impl, activation=activation,
                 capacity_factor=capacity_factor)
  return _moe_mlp(x, expert_ids, combine_weights, w_in, w_out, w_gate=w_gate, activation=activation,
                  capacity_factor=capacity_factor, impl=impl, precision=precision)


def _moe_mlp(x, expert_ids, combine_weights, w_in, w_out, *, w_gate, activation, capacity_factor, impl,
             precision, num_assignments: int | None = None):
  """moe_mlp after its checks. num_assignments: permute.dropless_placement's bound, which only a caller
  that guarantees it passes (token_rounding.rounded_moe_mlp)."""
  num_experts = w_in.shape[0]

  if capacity_factor is None:
    impl = resolve_impl(impl, jnp.result_type(x, w_in))
    blocked = impl in BLOCK_IMPLS
    block = BLOCK_SIZE if blocked else 1
    placement = permute.dropless_placement(expert_ids, num_experts, block_size=block,
                                           num_assignments=num_assignments)
    group_sizes = placement.group_sizes
    topology = (make_topology(group_sizes, placement.num_rows, block, placement.tokens_per_expert)
                if blocked else None)
  else:
    c = capacity(x.shape[0], num_experts, expert_ids.shape[1], capacity_factor)
    placement = permute.capacity_placement(expert_ids, num_experts, c)
    group_sizes = topology = None

  rows = permute.gather_rows(x, placement)
  out = expert_ffn(rows, group_sizes, w_in, w_out, w_gate=w_gate, activation=activation, impl=impl,
                   topology=topology, precision=precision)
  y = permute.scatter_rows(out, placement, combine_weights, x.dtype)
  stats = MoEStats(
      tokens_per_expert=placement.tokens_per_expert,
      num_dropped=placement.num_dropped,
      dropped_fraction=dropped_fraction(placement.num_dropped, placement.tokens_per_expert),
  )
  return y, stats


def expert_choice_mlp(
    x: Float[Array, "tokens d_model"],
    routing: ExpertChoiceRouting,
    w_in: Float[Array, "experts d_model d_ff"],
    w_out: Float[Array, "experts d_ff d_model"],
    *,
    w_gate: Float[Array, "experts d_model d_ff"] | None = None,
    activation: Callable = jax.nn.gelu,
    precision=None,
) -> tuple[Float[Array, "tokens d_model"], MoEStats]:
  """y[t] = sum over (e, c) with token_ids[e, c] = t of combine_weights[e, c] * FFN_e(x[t]).

  Every expert holds exactly C rows, so the expert FFN is the balanced batched einsum. Here a
  "dropped" token is one no expert chose, so num_dropped / T is the fraction.
  """
  _check_expert_weights(x, w_in, w_out, w_gate)
  _checks.check_activation(activation)
  if not isinstance(routing, ExpertChoiceRouting):
    raise TypeError(f"routing must be an ExpertChoiceRouting (from expert_choice_routing); got "
                    f"{type(routing).__name__}.")
  num_experts, cap = routing.token_ids.shape
  if num_experts != w_in.shape[0]:
    raise ValueError(f"routing has {num_experts} experts but w_in has {w_in.shape[0]}.")
  rows = x[routing.token_ids.reshape(-1)]
  out = expert_ffn(rows, None, w_in, w_out, w_gate=w_gate, activation=activation, precision=precision)
  weighted = out.astype(jnp.float32) * routing.combine_weights.reshape(-1, 1)
  y = jnp.zeros((x.shape[0], x.shape[1]), jnp.float32).at[routing.token_ids.reshape(-1)].add(weighted)
  chosen = jnp.zeros((x.shape[0],), jnp.int32).at[routing.token_ids.reshape(-1)].add(1)
  unprocessed = jnp.sum(chosen == 0).astype(jnp.int32)
  stats = MoEStats(
      tokens_per_expert=jnp.full((num_experts,), cap, jnp.int32),
      num_dropped=unprocessed,
      dropped_fraction=dropped_fraction(unprocessed, jnp.full((1,), x.shape[0], jnp.int32)),
  )
  return y.astype(x.dtype), stats
