"""group_rows as one Pallas Triton kernel: a decode step's placement of each expert's tokens in groups.

At batch 32 XLA ran the placement as five or six kernels a layer (the one-hot counts, ranks and starts, then
scatters of the rows and of the groups' experts): traced on an H200, the XLA kernels between the router's select and
the first expert product took 9.8 us a layer of medium-moe's step, against 4.1 with this kernel (2.5) and XLA's
count of tokens_per_expert, which the kernel now writes too, so nothing else runs there (notes_decode.md,
forty-ninth and fiftieth sessions). The placement is a few hundred integers, so here every program computes all of
it in registers ([P, P] and [P, E] comparisons of the pairs' ids, P and E at most a few dozen) and then moves its
[group, block_d] tile of rows; program (0, 0) also writes the groups' experts, the pairs' slots and the experts'
counts (the layer's tokens_per_expert, which XLA otherwise counts in a kernel of its own). Reference: reference.py.
Off the GPU the kernel runs in Pallas' interpret mode (tests).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from sparsejax.kernels import launch_dependents
from sparsejax.kernels.group_rows.reference import row_groups
from sparsejax.kernels.row_moves.triton import block_d_for  # the row gather's rule, at this kernel's block_d
from sparsejax.kernels.shared_lowering import shared_lowering


@dataclasses.dataclass(frozen=True)
class Config:
  """A program moves one group's rows x block_d columns (a power of two)."""
  block_d: int = 256
  num_warps: int = 4


# The [P, E] and [P, P] comparisons every program holds: P and E padded to powers of two, at most this many each.
MAX_PAIRS_X_EXPERTS = 16384


def fits(num_pairs: int, num_experts: int, d: int, group: int) -> bool:
  """Whether the kernel takes these shapes: its comparisons fit (MAX_PAIRS_X_EXPERTS), d has a column block
  (block_d_for) and group is a power of two (a block's rows)."""
  p, e = pl.next_power_of_2(num_pairs), pl.next_power_of_2(num_experts)
  return (num_pairs > 0 and p * max(p, e) <= MAX_PAIRS_X_EXPERTS and block_d_for(d, Config()) is not None
          and group > 0 and group & (group - 1) == 0)


def _placement(ids_ref, *, num_experts: int, group: int, groups: int):
  """(pairs' ids [Pp], valid, group, row) of every pair, Pp = P padded to a power of two (padding: no expert).
  rank_a = #{b < a: id_b = id_a}; expert e's groups start at sum_{e' < e} ceil(c_e' / G)."""
  from jax.experimental.pallas import triton as plt
  n = ids_ref.shape[0]
  pp, ep = pl.next_power_of_2(n), pl.next_power_of_2(num_experts)
  a = jax.lax.broadcasted_iota(jnp.int32, (pp,), 0)
  key = plt.load(ids_ref.at[a], mask=a < n, other=-1)
  valid = (key >= 0) & (key < num_experts)
  key = jnp.where(valid, key, num_experts)
  earlier_same = (key[:, None] == key[None, :]) & (a[None, :] < a[:, None])
  rank = jnp.sum(earlier_same.astype(jnp.int32), axis=1)
  e = jax.lax.broadcasted_iota(jnp.int32, (1, ep), 1)
  counts = jnp.sum(((key[:, None] == e) & valid[:, None]).astype(jnp.int32), axis=0)  # [Ep]
  per_expert = jax.lax.div(counts + (group - 1), group)
  start = jnp.sum(jnp.where(e < key[:, None], per_expert[None, :], 0), axis=1)  # [Pp]
  grp = jnp.where(valid, start + jax.lax.div(rank, group), groups)
  row = jax.lax.rem(rank, group)
  return a, key, valid, grp, row, counts


def _kernel(ids_ref, x_ref, xs_ref, experts_ref, slot_ref, counts_ref, *, num_experts: int, group: int, groups: int,
            per_token: int, block_d: int):
  from jax.experimental.pallas import triton as plt
  a, key, valid, grp, row, counts = _placement(ids_ref, num_experts=num_experts, group=group, groups=groups)
  g, j = pl.program_id(0), pl.program_id(1)
  r = jax.lax.broadcasted_iota(jnp.int32, (group, 1), 0)
  match = (grp[None, :] == g) & (row[None, :] == r)  # [G, Pp]: the pair in row r of group g, if any
  token = jnp.sum(jnp.where(match, jax.lax.div(a, per_token)[None, :], 0), axis=1)
  filled = jnp.sum(match.astype(jnp.int32), axis=1) > 0
  cols = j * block_d + jax.lax.broadcasted_iota(jnp.int32, (1, block_d), 1)
  mask = jnp.broadcast_to(filled[:, None], (group, block_d))
  # Both indices as arrays (interpret mode takes no mix of arrays and slices); Triton still moves each row's
  # contiguous columns in vectors.
  xs_ref[0] = plt.load(x_ref.at[token[:, None], cols], mask=mask, other=0)

  @pl.when((g == 0) & (j == 0))
  def _():
    n = ids_ref.shape[0]
    gp = pl.next_power_of_2(groups)
    gi = jax.lax.broadcasted_iota(jnp.int32, (gp, 1), 0)
    ex = jnp.max(jnp.where(grp[None, :] == gi, key[None, :], -1), axis=1)  # a group's pairs share one expert
    gv = gi[:, 0]
    plt.store(experts_ref.at[gv], jnp.where(ex < 0, num_experts, ex), mask=gv < groups)
    plt.store(slot_ref.at[a], jnp.where(valid, grp * group + row, groups * group), mask=a < n)
    e = jax.lax.broadcasted_iota(jnp.int32, counts.shape, 0)
    plt.store(counts_ref.at[e], counts, mask=e < num_experts)


@shared_lowering("num_experts", "group", "cfg")
def group_rows(
    x: Float[Array, "tokens d"], ids: Int[Array, "pairs"], num_experts: int, group: int, cfg: Config = Config(),
    *, interpret: bool = False
) -> tuple[Float[Array, "groups group d"], Int[Array, "groups"], Int[Array, "pairs"], Int[Array, "experts"]]:
  """(xs, experts, slot, counts) of op.group_rows; fits(len(ids), num_experts, d, group) holds."""
  (t, d), n = x.shape, ids.shape[0]
  groups, bd = row_groups(n, num_experts, group), block_d_for(d, cfg)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1)
  return launch_dependents.pallas_call(
      functools.partial(_kernel, num_experts=num_experts, group=group, groups=groups, per_token=n // t, block_d=bd),
      grid=(groups, d // bd),
      in_specs=[pl.no_block_spec, pl.no_block_spec],
      out_specs=[pl.BlockSpec((1, group, bd), lambda g, j: (g, 0, j))] + [pl.no_block_spec] * 3,
      out_shape=[jax.ShapeDtypeStruct((groups, group, d), x.dtype), jax.ShapeDtypeStruct((groups,), jnp.int32),
                 jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((num_experts,), jnp.int32)],
      interpret=interpret, compiler_params=params, name="sparsejax_group_rows",
  )(ids.astype(jnp.int32), x)
