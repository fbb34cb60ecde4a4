"""Grouped matrix multiply: the expert computation of a dropless MoE.

out[i] = lhs[i] @ rhs[g(i)], where g(i) is the group whose row range holds i; rows past
sum(group_sizes) are zero. This is `jax.lax.ragged_dot`'s contract; the backends differ only in speed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax import _checks

IMPLS = ("auto", "reference", "ragged_dot", "pallas")


def resolve_impl(impl: str) -> str:
  """Map "auto" to the fastest backend for the default device: Pallas on GPU, ragged_dot elsewhere."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  if impl != "auto":
    return impl
  return "pallas" if jax.default_backend() == "gpu" else "ragged_dot"


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


def _ragged_dot(lhs, rhs, group_sizes):
  out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
  return out.astype(lhs.dtype)


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
  from pallas_kernels import gmm  # the GPU kernels live beside their references

  return gmm.grouped_matmul_pallas(lhs, rhs, group_sizes)
