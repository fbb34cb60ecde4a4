"""Grouped matrix multiply: the expert computation of a dropless MoE.

out[i] = lhs[i] @ rhs[g(i)], where g(i) is the group whose row range holds i; rows past
sum(group_sizes) are zero. This is `jax.lax.ragged_dot`'s contract; the backends differ only in speed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax import _checks

IMPLS = ("auto", "reference", "ragged_dot", "pallas", "mosaic", "triton")
# The Pallas kernels: "pallas" is the best of them for the GPU at hand (Mosaic GPU on Hopper,
# Triton elsewhere); "mosaic" and "triton" name one. All of them use the 128-row padded layout.
BLOCK_IMPLS = ("pallas", "mosaic", "triton")


def resolve_impl(impl: str) -> str:
  """Map "auto" to the fastest backend for the default device: Pallas on GPU, ragged_dot elsewhere."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  if impl != "auto":
    return impl
  return "pallas" if jax.default_backend() == "gpu" else "ragged_dot"


def kernel_backend(impl: str) -> str:
  """The sparsejax.kernels.gmm backend of a block-layout impl ("pallas" lets the GPU decide)."""
  return "auto" if impl == "pallas" else impl


def check_grouped_matmul_args(lhs, rhs, group_sizes) -> None:
  _checks.check_rank("lhs", lhs, 2, "[rows, K]")
  _checks.check_rank("rhs", rhs, 3, "[groups, K, N]")
  _checks.check_floating("lhs", lhs)
  _checks.check_same_dtype(lhs=lhs, rhs=rhs)
  if lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"lhs has K={lhs.shape[1]} but rhs has K={rhs.shape[1]} (rhs is [groups, K, N]).")
  _checks.check_rank("group_sizes", group_sizes, 1, "[groups]")
  _checks.check_integer("group_sizes", group_sizes)
  if group_sizes.shape[0] != rhs.shape[0]:
    raise ValueError(
        f"group_sizes has {group_sizes.shape[0]} entries but rhs has {rhs.shape[0]} groups.")


def grouped_matmul_reference(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "groups k n"],
    group_sizes: Int[Array, "groups"],
) -> Float[Array, "rows n"]:
  """Obviously right: for every group g, the dense product lhs @ rhs[g] masked to g's rows, in float32."""
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  rows = jnp.arange(lhs.shape[0])[:, None]
  out = jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32)
  lhs32 = lhs.astype(jnp.float32)
  for g in range(rhs.shape[0]):
    in_group = (rows >= starts[g]) & (rows < ends[g])
    prod = jnp.matmul(lhs32, rhs[g].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    out = out + jnp.where(in_group, prod, 0.0)
  return out.astype(lhs.dtype)


def _ragged_dot_raw(lhs, rhs, group_sizes):
  out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
  return out.astype(lhs.dtype)


def _ragged_dot_raw_vjp(lhs, rhs, group_sizes, ct):
  _, vjp = jax.vjp(lambda a, b: _ragged_dot_raw(a, b, group_sizes), lhs, rhs)
  return vjp(ct)


def _vmap_all_batched(fn):
  """jax.lax.ragged_dot's batching rule handles only the case where every operand is batched on
  axis 0 (vmap with unbatched weights raises NotImplementedError). Broadcast the unbatched operands
  so the rule sees that case. custom_vmap has no reverse mode, hence the custom_vjp around it."""
  op = jax.custom_batching.custom_vmap(fn)

  @op.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]
    out = jax.vmap(fn)(*args)
    return out, jax.tree.map(lambda _: True, out)

  return op


_ragged_dot_fwd_op = _vmap_all_batched(_ragged_dot_raw)
_ragged_dot_bwd_op = _vmap_all_batched(_ragged_dot_raw_vjp)


@jax.custom_vjp
def _ragged_dot(lhs, rhs, group_sizes):
  return _ragged_dot_fwd_op(lhs, rhs, group_sizes)


def _ragged_dot_fwd(lhs, rhs, group_sizes):
  return _ragged_dot_fwd_op(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _ragged_dot_bwd(res, ct):
  lhs, rhs, group_sizes = res
  d_lhs, d_rhs = _ragged_dot_bwd_op(lhs, rhs, group_sizes, ct)
  return d_lhs, d_rhs, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def grouped_matmul(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "groups k n"],
    group_sizes: Int[Array, "groups"],
    *,
    impl: str = "auto",
) -> Float[Array, "rows n"]:
  """out[i] = lhs[i] @ rhs[g] for rows i in group g (groups are consecutive row blocks), zero past them.

  Accumulates in float32 and returns lhs.dtype; differentiable in lhs and rhs. impl: "reference",
  "ragged_dot", "pallas" (the Pallas GPU kernels; interpret mode off the GPU) or "auto".
  """
  group_sizes = jnp.asarray(group_sizes)
  check_grouped_matmul_args(lhs, rhs, group_sizes)
  impl = resolve_impl(impl)
  group_sizes = group_sizes.astype(jnp.int32)
  if impl == "reference":
    return grouped_matmul_reference(lhs, rhs, group_sizes)
  if impl == "ragged_dot":
    return _ragged_dot(lhs, rhs, group_sizes)
  from sparsejax.kernels import gmm  # the GPU kernels live beside their references

  return gmm.grouped_matmul_padded(lhs, rhs, group_sizes, backend=kernel_backend(impl))
