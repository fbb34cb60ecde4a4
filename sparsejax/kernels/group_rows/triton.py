"""group_rows as one Pallas Triton kernel: a decode step's placement of each expert's tokens in groups.

At batch 32 XLA ran the placement as seven kernels a layer (the one-hot counts, ranks and starts, then scatters
of the rows and of the group's experts; 11.4 us a layer of medium-moe's step on an H200,
experiments/notes_decode.md, forty-ninth session). The placement is a few hundred integers, so here every
program computes all of it in registers ([P, P] and [P, E] comparisons of the pairs' ids, P and E at most a few
dozen) and then moves its [group, block_d] tile of rows; program (0, 0) also writes the groups' experts and the
pairs' slots. Routed (route_group_rows), the programs also take the pairs' experts from the router's partial logits
themselves (decode_router's select, summed and compared as its kernels do), so the router's select kernel does not
run either. Reference: reference.py. Off the GPU the kernel runs in Pallas' interpret mode (tests).
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
from sparsejax.kernels.shared_lowering import shared_lowering


@dataclasses.dataclass(frozen=True)
class Config:
  """A program moves one group's rows x block_d columns (a power of two)."""
  block_d: int = 256
  num_warps: int = 4


# The [P, E] and [P, P] comparisons every program holds: P and E padded to powers of two, at most this many each.
MAX_PAIRS_X_EXPERTS = 16384


def block_d_for(d: int, cfg: Config = Config()) -> int | None:
  """The column block for width d: cfg.block_d, or d itself when smaller and a power of two; None when neither
  divides d."""
  bd = min(cfg.block_d, d)
  return bd if bd & (bd - 1) == 0 and d % bd == 0 else None


def fits(num_pairs: int, num_experts: int, d: int) -> bool:
  """Whether the kernel takes these shapes: its comparisons fit (MAX_PAIRS_X_EXPERTS) and block_d_for(d) exists."""
  p, e = pl.next_power_of_2(num_pairs), pl.next_power_of_2(num_experts)
  return num_pairs > 0 and p * max(p, e) <= MAX_PAIRS_X_EXPERTS and block_d_for(d) is not None


def _loaded_ids(ids_ref):
  """(a, ids[a]) over a < Pp = P padded to a power of two; the padding pairs' id -1 (no expert)."""
  from jax.experimental.pallas import triton as plt
  n = ids_ref.shape[0]
  a = jax.lax.broadcasted_iota(jnp.int32, (pl.next_power_of_2(n),), 0)
  return a, plt.load(ids_ref.at[a], mask=a < n, other=-1)


def _routed_ids(part_ref, *, tokens: int, k: int, renormalize: bool, splits: int):
  """(a, ids[a], [ids_j], [weights_j]): decode_router's select of every token from its partial logits (part_ref
  [T, splits * E]), pair a = t k + j holding token t's j-th expert; ids_j and weights_j are [Tp] (T padded to a
  power of two). The parts are summed in split order and the top k taken by comparisons, as
  decode_router.triton.summed_logits and top_ids do, so the ids are its kernels' (weights_of's softmax, here over
  each row at once, agrees to float32 rounding)."""
  from jax.experimental.pallas import triton as plt
  e = part_ref.shape[1] // splits
  tp = pl.next_power_of_2(tokens)
  t = jax.lax.broadcasted_iota(jnp.int32, (tp, 1), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (1, e), 1)
  mask = jnp.broadcast_to(t < tokens, (tp, e))
  logits = plt.load(part_ref.at[t, col], mask=mask, other=0.0)
  for s in range(1, splits):
    logits = logits + plt.load(part_ref.at[t, s * e + col], mask=mask, other=0.0)
  free = jnp.ones((tp, e), jnp.int32)  # 0 once taken (top_ids' mask: a logit of -inf is still taken in turn)
  ids = []
  for _ in range(k):
    best = jnp.max(jnp.where(free > 0, logits, -jnp.inf), axis=1)
    idx = jnp.min(jnp.where((free > 0) & (logits == best[:, None]), col, e), axis=1)
    ids.append(idx)
    free = jnp.where(col == idx[:, None], 0, free)
  z = jnp.exp(logits - jnp.max(logits, axis=1)[:, None])
  p = z / jnp.sum(z, axis=1)[:, None]
  wts = [jnp.sum(jnp.where(col == i[:, None], p, 0.0), axis=1) for i in ids]
  if renormalize:
    total = wts[0]
    for w in wts[1:]:
      total = total + w
    wts = [w / total for w in wts]
  n = tokens * k
  a = jax.lax.broadcasted_iota(jnp.int32, (pl.next_power_of_2(n),), 0)
  owner = jax.lax.div(a, k)[:, None] == jax.lax.broadcasted_iota(jnp.int32, (1, tp), 1)  # [Pp, Tp]
  key = jnp.full(a.shape, -1, jnp.int32)
  for j, i in enumerate(ids):
    key = jnp.where(jax.lax.rem(a, k) == j, jnp.sum(jnp.where(owner, i[None, :], 0), axis=1), key)
  return a, jnp.where(a < n, key, -1), ids, wts


def _placement(a, key, *, num_experts: int, group: int, groups: int):
  """(ids with no expert as E, valid, group, row) of every pair a < Pp (padding pairs: id -1, no expert).
  rank_a = #{b < a: id_b = id_a}; expert e's groups start at sum_{e' < e} ceil(c_e' / G)."""
  ep = pl.next_power_of_2(num_experts)
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
  return key, valid, grp, row


@dataclasses.dataclass(frozen=True)
class Route:
  """The routed form's select: k experts a token from the router's `splits` partial logits."""
  k: int
  renormalize: bool
  splits: int


def _kernel(src_ref, x_ref, xs_ref, experts_ref, slot_ref, *route_refs, num_experts: int, group: int, groups: int,
            per_token: int, block_d: int, route: Route | None):
  from jax.experimental.pallas import triton as plt
  tokens, n = x_ref.shape[0], x_ref.shape[0] * per_token
  if route is None:
    a, ids = _loaded_ids(src_ref)
  else:
    a, ids, top, wts = _routed_ids(src_ref, tokens=tokens, k=route.k, renormalize=route.renormalize,
                                   splits=route.splits)
  key, valid, grp, row = _placement(a, ids, num_experts=num_experts, group=group, groups=groups)
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
    gp = pl.next_power_of_2(groups)
    gi = jax.lax.broadcasted_iota(jnp.int32, (gp, 1), 0)
    ex = jnp.max(jnp.where(grp[None, :] == gi, key[None, :], -1), axis=1)  # a group's pairs share one expert
    gv = gi[:, 0]
    plt.store(experts_ref.at[gv], jnp.where(ex < 0, num_experts, ex), mask=gv < groups)
    plt.store(slot_ref.at[a], jnp.where(valid, grp * group + row, groups * group), mask=a < n)
    if route is not None:  # the select's [T, k] ids and weights, as decode_router returns them
      ids_ref, wts_ref = route_refs
      kp = pl.next_power_of_2(route.k)
      t = jax.lax.broadcasted_iota(jnp.int32, (top[0].shape[0], 1), 0)
      choice = jax.lax.broadcasted_iota(jnp.int32, (1, kp), 1)
      id_mat, wt_mat = jnp.zeros((t.shape[0], kp), jnp.int32), jnp.zeros((t.shape[0], kp), jnp.float32)
      for jj in range(route.k):
        id_mat = jnp.where(choice == jj, top[jj][:, None], id_mat)
        wt_mat = jnp.where(choice == jj, wts[jj][:, None], wt_mat)
      inside = (t < tokens) & (choice < route.k)
      plt.store(ids_ref.at[t, choice], id_mat, mask=inside)
      plt.store(wts_ref.at[t, choice], wt_mat, mask=inside)


def fits_route(tokens: int, num_experts: int, k: int, d: int) -> bool:
  """Whether the routed form takes these shapes: fits, E a power of two (the logits' blocks) and k at most the
  passes decode_router's select takes."""
  from sparsejax.top_k import MAX_PASSES_K
  return fits(tokens * k, num_experts, d) and num_experts & (num_experts - 1) == 0 and k <= MAX_PASSES_K


def _call(x, src, num_experts: int, group: int, n: int, cfg: Config, route: Route | None, interpret: bool):
  t, d = x.shape
  groups, bd = row_groups(n, num_experts, group), block_d_for(d, cfg)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1)
  out_shape = [jax.ShapeDtypeStruct((groups, group, d), x.dtype), jax.ShapeDtypeStruct((groups,), jnp.int32),
               jax.ShapeDtypeStruct((n,), jnp.int32)]
  if route is not None:
    out_shape += [jax.ShapeDtypeStruct((t, route.k), jnp.int32), jax.ShapeDtypeStruct((t, route.k), jnp.float32)]
  return launch_dependents.pallas_call(
      functools.partial(_kernel, num_experts=num_experts, group=group, groups=groups, per_token=n // t, block_d=bd,
                        route=route),
      grid=(groups, d // bd),
      in_specs=[pl.no_block_spec, pl.no_block_spec],
      out_specs=[pl.BlockSpec((1, group, bd), lambda g, j: (g, 0, j))] + [pl.no_block_spec] * (len(out_shape) - 1),
      out_shape=out_shape, interpret=interpret, compiler_params=params, name="sparsejax_group_rows",
  )(src, x)


@shared_lowering("num_experts", "group", "cfg")
def group_rows(
    x: Float[Array, "tokens d"], ids: Int[Array, "pairs"], num_experts: int, group: int, cfg: Config = Config(),
    *, interpret: bool = False
) -> tuple[Float[Array, "groups group d"], Int[Array, "groups"], Int[Array, "pairs"]]:
  """(xs, experts, slot) of op.group_rows; fits(len(ids), num_experts, d) holds."""
  return tuple(_call(x, ids.astype(jnp.int32), num_experts, group, ids.shape[0], cfg, None, interpret))


@shared_lowering("k", "renormalize", "group", "cfg")
def route_group_rows(
    x: Float[Array, "tokens d"], parts: Float[Array, "tokens splits experts"], k: int, renormalize: bool, group: int,
    cfg: Config = Config(), *, interpret: bool = False
) -> tuple:
  """(xs, experts, slot, ids, weights) of op.route_group_rows; fits_route(tokens, E, k, d) holds."""
  t, splits, e = parts.shape
  return tuple(_call(x, parts.reshape(t, splits * e), e, group, t * k, cfg, Route(k, renormalize, splits), interpret))
