"""group_rows: a decode step's placement of each expert's tokens in groups of `group` rows.

  pair a = (t, j) of ids [T k] (ids[a] = e[t, j]; one outside [0, E) holds no expert) sits in row r_a % G of
  group g_a = start[e] + r_a // G, r_a = #{b < a: e_b = e_a}, start[e] = sum_{e' < e} ceil(c_e' / G);
  xs[g_a, r_a % G] = x[t] (every other row 0), experts[g] = the expert of group g's pairs (E for a group no pair
  fills), slot[a] = g_a G + r_a % G (groups G where a holds no expert).
route_group_rows takes the pairs' experts from the router's partial logits instead of ids (decode_router's select:
decode_router.router_logit_parts' parts, the k largest summed logits a token) and also returns that select's ids
and weights, so at a decode step the router's select kernel does not run.
groups = reference.row_groups(T k, E, G), a static bound, so one compile serves every routing; an expert with more
than G tokens fills several groups. The decode MoE layer (inference.decode_moe) runs each group's rows through its
expert (skinny_matmul) and gathers the pairs' rows back by slot.
Backends: "triton" (triton.py; off the GPU in interpret mode) and "xla" (reference.py); "auto" takes triton on a
GPU where the kernel fits (triton.fits, triton.fits_route), where this jax has Pallas' Triton backend.
Differentiable in x (and the parts, through the weights): the reference's cotangents.
"""
from __future__ import annotations

import jax
from jaxtyping import Array, Float, Int

from sparsejax import _checks
from sparsejax.kernels import auto_takes_triton, require_triton
from sparsejax.kernels._reference_vjp import with_reference_vjp
from sparsejax.kernels.group_rows import triton
from sparsejax.kernels.decode_router.reference import select_from_parts
from sparsejax.kernels.group_rows.reference import group_rows_reference

IMPLS = ("auto", "triton", "xla")


def runs_kernel(num_pairs: int, num_experts: int, d: int, impl: str = "auto") -> bool:
  """Whether group_rows runs the Pallas kernel: impl "triton", or "auto" on a GPU where triton.fits holds and
  this jax has Pallas' Triton backend."""
  if impl == "triton":
    return True
  return (impl == "auto" and jax.default_backend() == "gpu" and triton.fits(num_pairs, num_experts, d)
          and auto_takes_triton())


def routes_kernel(tokens: int, num_experts: int, k: int, d: int, impl: str = "auto") -> bool:
  """Whether route_group_rows runs the Pallas kernel: impl "triton", or "auto" on a GPU where triton.fits_route
  holds and this jax has Pallas' Triton backend."""
  if impl == "triton":
    return True
  return (impl == "auto" and jax.default_backend() == "gpu" and triton.fits_route(tokens, num_experts, k, d)
          and auto_takes_triton())


def _check_x(x, num_experts, group, impl):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  _checks.check_rank("x", x, 2, "[tokens, d]")
  _checks.check_tokens("x", x)
  if num_experts < 1 or group < 1:
    raise ValueError(f"num_experts and group must be positive; got {num_experts} and {group}.")


def _check(x, ids, num_experts, group, impl):
  _check_x(x, num_experts, group, impl)
  _checks.check_rank("ids", ids, 1, "[pairs]")
  _checks.check_integer("ids", ids)
  if ids.shape[0] % x.shape[0]:
    raise ValueError(f"ids must hold k pairs a token, [tokens * k]; got {ids.shape[0]} ids for {x.shape[0]} tokens.")
  if impl == "triton":
    require_triton("group_rows(impl='triton')")
    if not triton.fits(ids.shape[0], num_experts, x.shape[1]) or group & (group - 1):
      raise ValueError(f"impl='triton' needs d a multiple of {triton.Config().block_d} or a smaller power of two, "
                       f"a power-of-two group and (pairs x experts) within its registers; got d={x.shape[1]}, "
                       f"group={group}, {ids.shape[0]} pairs, {num_experts} experts (use impl='auto').")


def group_rows(
    x: Float[Array, "tokens d"], ids: Int[Array, "pairs"], num_experts: int, *, group: int = 16, impl: str = "auto"
) -> tuple[Float[Array, "groups group d"], Int[Array, "groups"], Int[Array, "pairs"]]:
  """(xs, experts, slot): each expert's tokens in groups of `group` rows (module doc)."""
  _check(x, ids, num_experts, group, impl)
  if group & (group - 1) == 0 and runs_kernel(ids.shape[0], num_experts, x.shape[1], impl):
    interpret = jax.default_backend() != "gpu"
    kernel = lambda x, ids: triton.group_rows(x, ids, num_experts, group, interpret=interpret)
    reference = lambda x, ids: group_rows_reference(x, ids, num_experts, group)
    return with_reference_vjp(kernel, reference, x, ids)
  return group_rows_reference(x, ids, num_experts, group)


def route_group_rows(
    x: Float[Array, "tokens d"], parts: Float[Array, "tokens splits experts"], k: int, *,
    renormalize: bool | None = None, group: int = 16, impl: str = "auto"
) -> tuple[Float[Array, "groups group d"], Int[Array, "groups"], Int[Array, "pairs"], Int[Array, "tokens k"],
           Float[Array, "tokens k"]]:
  """(xs, experts, slot, ids, weights): ids, weights = decode_router's select of the partial logits (the k largest
  of sum_s parts[t, s], largest first; softmax weights, renormalized when renormalize, None meaning "k > 1"), and
  group_rows(x, ids.reshape(-1), E) (module doc)."""
  _checks.check_floating("parts", parts)
  if parts.ndim != 3 or x.ndim != 2 or parts.shape[0] != x.shape[0]:
    raise ValueError(f"parts must be [tokens, splits, experts] (router_logit_parts') for x [tokens, d]; got "
                     f"shapes {parts.shape} and {x.shape}.")
  t, _, e = parts.shape
  _check_x(x, e, group, impl)
  _checks.check_top_k(k, e)
  renormalize = k > 1 if renormalize is None else bool(renormalize)
  if impl == "triton":
    require_triton("route_group_rows(impl='triton')")
    if not triton.fits_route(t, e, k, x.shape[1]) or group & (group - 1):
      raise ValueError(f"impl='triton' needs d a multiple of {triton.Config().block_d} or a smaller power of two, "
                       f"a power-of-two expert count and group, k <= 8 and (pairs x experts) within its registers; "
                       f"got d={x.shape[1]}, {e} experts, group={group}, k={k}, {t * k} pairs (use impl='auto').")

  def reference(x, parts):
    ids, wts = select_from_parts(parts, k, renormalize)
    return (*group_rows_reference(x, ids.reshape(-1), e, group), ids, wts)

  if group & (group - 1) == 0 and routes_kernel(t, e, k, x.shape[1], impl):
    interpret = jax.default_backend() != "gpu"
    kernel = lambda x, parts: triton.route_group_rows(x, parts, k, renormalize, group, interpret=interpret)
    return with_reference_vjp(kernel, reference, x, parts)
  return reference(x, parts)
