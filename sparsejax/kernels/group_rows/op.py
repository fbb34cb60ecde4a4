"""group_rows: a decode step's placement of each expert's tokens in groups of `group` rows.

  pair a = (t, j) of ids [T k] (ids[a] = e[t, j]; one outside [0, E) holds no expert) sits in row r_a % G of
  group g_a = start[e] + r_a // G, r_a = #{b < a: e_b = e_a}, start[e] = sum_{e' < e} ceil(c_e' / G);
  xs[g_a, r_a % G] = x[t] (every other row 0), experts[g] = the expert of group g's pairs (E for a group no pair
  fills), slot[a] = g_a G + r_a % G (groups G where a holds no expert), counts[e] = c_e (the layer's
  tokens_per_expert).
groups = reference.row_groups(T k, E, G), a static bound, so one compile serves every routing; an expert with more
than G tokens fills several groups. The decode MoE layer (inference.decode_moe) runs each group's rows through its
expert (skinny_matmul) and gathers the pairs' rows back by slot.
Backends: "triton" (triton.py; off the GPU in interpret mode) and "xla" (reference.py); "auto" takes triton on a
GPU where the kernel fits (triton.fits), where this jax has Pallas' Triton backend. Differentiable in x: the
reference's cotangents (the scatter's transpose).
"""
from __future__ import annotations

import jax
from jaxtyping import Array, Float, Int

from sparsejax import _checks
from sparsejax.kernels import auto_takes_triton, require_triton
from sparsejax.kernels._reference_vjp import with_reference_vjp
from sparsejax.kernels.group_rows import triton
from sparsejax.kernels.group_rows.reference import group_rows_reference

IMPLS = ("auto", "triton", "xla")
GROUP = 16  # rows a group, by default


def runs_kernel(num_pairs: int, num_experts: int, d: int, impl: str = "auto", group: int = GROUP) -> bool:
  """Whether group_rows runs the Pallas kernel: impl "triton", or "auto" on a GPU where triton.fits holds and
  this jax has Pallas' Triton backend."""
  if impl == "triton":
    return True
  return (impl == "auto" and jax.default_backend() == "gpu" and triton.fits(num_pairs, num_experts, d, group)
          and auto_takes_triton())


def _check(x, ids, num_experts, group, impl):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  _checks.check_rank("x", x, 2, "[tokens, d]")
  _checks.check_rank("ids", ids, 1, "[pairs]")
  _checks.check_integer("ids", ids)
  if x.shape[0] == 0 or ids.shape[0] % x.shape[0]:
    raise ValueError(f"ids must hold k pairs a token, [tokens * k]; got {ids.shape[0]} ids for {x.shape[0]} tokens.")
  if num_experts < 1 or group < 1:
    raise ValueError(f"num_experts and group must be positive; got {num_experts} and {group}.")
  if impl == "triton":
    require_triton("group_rows(impl='triton')")
    if not triton.fits(ids.shape[0], num_experts, x.shape[1], group):
      raise ValueError(f"impl='triton' needs d a multiple of {triton.Config().block_d} or a smaller power of two, "
                       f"a power-of-two group and (pairs x experts) within its registers; got d={x.shape[1]}, "
                       f"group={group}, {ids.shape[0]} pairs, {num_experts} experts (use impl='auto').")


def group_rows(
    x: Float[Array, "tokens d"], ids: Int[Array, "pairs"], num_experts: int, *, group: int = GROUP, impl: str = "auto"
) -> tuple[Float[Array, "groups group d"], Int[Array, "groups"], Int[Array, "pairs"], Int[Array, "experts"]]:
  """(xs, experts, slot, counts): each expert's tokens in groups of `group` rows (module doc)."""
  _check(x, ids, num_experts, group, impl)
  if runs_kernel(ids.shape[0], num_experts, x.shape[1], impl, group):
    interpret = jax.default_backend() != "gpu"
    kernel = lambda x, ids: triton.group_rows(x, ids, num_experts, group, interpret=interpret)
    reference = lambda x, ids: group_rows_reference(x, ids, num_experts, group)
    return with_reference_vjp(kernel, reference, x, ids)
  return group_rows_reference(x, ids, num_experts, group)
