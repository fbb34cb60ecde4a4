"""Grouped matrix multiply: the expert computation of a dropless MoE.

out[i] = lhs[i] @ rhs[g(i)], where g(i) is the group whose row range holds i; rows past
sum(group_sizes) are zero. This is `jax.lax.ragged_dot`'s contract, its optional arguments included
(precision, preferred_element_type, group_offset); the backends differ only in speed.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from sparsejax import _checks
from sparsejax._precision import full_precision
from sparsejax.kernels import auto_takes_triton, require_triton

IMPLS = ("auto", "reference", "ragged_dot", "pallas", "mosaic", "triton")
# The Pallas kernels: "pallas" is the best of them for the GPU at hand (Mosaic GPU on Hopper,
# Triton elsewhere); "mosaic" and "triton" name one. All of them use the 128-row padded layout.
BLOCK_IMPLS = ("pallas", "mosaic", "triton")


def resolve_impl(impl: str, dtype=None) -> str:
  """Map "auto" to the fastest backend for the default device: Pallas on GPU, ragged_dot elsewhere. Where the
  Pallas kernels for operands of dtype would be Triton's (every GPU but Hopper, and float32 on it; dtype None: not
  float32) and cannot run (no Pallas Triton backend in this jax, or a GPU before sm_80), "auto" takes ragged_dot;
  without the backend "pallas" / "triton" raise."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  if impl == "auto" and jax.default_backend() != "gpu":
    return "ragged_dot"
  pallas = "pallas" if impl == "auto" else impl
  if pallas in ("pallas", "triton") and _runs_triton(pallas, dtype):
    if impl != "auto":
      require_triton(f"grouped_matmul(impl={impl!r})", "impl='auto' or impl='ragged_dot'")
    elif not auto_takes_triton():  # it warns once that the XLA path runs
      return "ragged_dot"
  return pallas


def _runs_triton(impl: str, dtype) -> bool:
  """Whether a block impl's kernels for operands of dtype are Pallas Triton's (gmm.op.runs_triton)."""
  from sparsejax.kernels.gmm import op  # the GPU kernels live beside their references
  return op.runs_triton(kernel_backend(impl), dtype)


def kernel_backend(impl: str) -> str:
  """The sparsejax.kernels.gmm backend of a block-layout impl ("pallas" lets the GPU decide)."""
  return "auto" if impl == "pallas" else impl


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_grouped_matmul_args(lhs, rhs, group_sizes, group_offset=None,
                              preferred_element_type=None) -> None:
  _checks.check_rank("lhs", lhs, 2, "[rows, K]")
  _checks.check_rank("rhs", rhs, 3, "[groups, K, N]")
  _checks.check_floating("lhs", lhs)
  _checks.check_floating("rhs", rhs)
  if lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"lhs has K={lhs.shape[1]} but rhs has K={rhs.shape[1]} (rhs is [groups, K, N]).")
  _checks.check_rank("group_sizes", group_sizes, 1, "[groups]")
  _checks.check_integer("group_sizes", group_sizes)
  if preferred_element_type is not None and not jnp.issubdtype(preferred_element_type, jnp.floating):
    raise TypeError(f"preferred_element_type must be a floating dtype; got {preferred_element_type}.")
  if _is_concrete(group_sizes):  # given eagerly: check what the kernels would silently clip
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
      raise ValueError(f"group_sizes must be >= 0; got {sizes.tolist()}.")
    if sizes.sum() > lhs.shape[0]:
      raise ValueError(f"group_sizes sum to {int(sizes.sum())}, more than lhs's {lhs.shape[0]} rows.")
  if group_offset is None:
    if group_sizes.shape[0] != rhs.shape[0]:
      raise ValueError(
          f"group_sizes has {group_sizes.shape[0]} entries but rhs has {rhs.shape[0]} groups.")
    return
  if group_sizes.shape[0] < rhs.shape[0]:
    raise ValueError(f"group_offset selects rhs.shape[0]={rhs.shape[0]} consecutive groups of "
                     f"group_sizes, which has only {group_sizes.shape[0]}.")
  _checks.check_integer("group_offset", group_offset)
  if jnp.shape(group_offset) not in ((), (1,)):
    raise ValueError(f"group_offset must have shape () or (1,); got {jnp.shape(group_offset)}.")
  if _is_concrete(group_offset):
    o = int(jnp.reshape(group_offset, ()))
    last = group_sizes.shape[0] - rhs.shape[0]
    if not 0 <= o <= last:
      raise ValueError(f"group_offset={o} must be in [0, {last}] (len(group_sizes) - rhs.shape[0]).")


def _local_group_sizes(group_sizes, offset, num_local: int):
  """Sizes of groups offset .. offset + num_local - 1 (zero for groups past the end), and the row
  where group `offset` starts."""
  num_groups = group_sizes.shape[0]
  idx = offset + jnp.arange(num_local, dtype=jnp.int32)
  exists = (idx >= 0) & (idx < num_groups)
  local = jnp.where(exists, group_sizes[jnp.clip(idx, 0, num_groups - 1)], 0)
  start = jnp.sum(jnp.where(jnp.arange(num_groups) < offset, group_sizes, 0))
  return local.astype(jnp.int32), start.astype(jnp.int32)


def grouped_matmul_reference(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "groups k n"],
    group_sizes: Int[Array, "all_groups"],
    *,
    preferred_element_type=None,
    group_offset: Int[Array, ""] | None = None,
) -> Float[Array, "rows n"]:
  """Obviously right: for each rhs group j (group g = group_offset + j of group_sizes), the dense
  product lhs @ rhs[j] in float32 (HIGHEST) masked to g's rows; the sum, cast to
  preferred_element_type (default: the promoted input dtype)."""
  out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
  offset = 0 if group_offset is None else jnp.reshape(group_offset, ()).astype(jnp.int32)
  num_groups = group_sizes.shape[0]
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  rows = jnp.arange(lhs.shape[0])[:, None]
  compute = jnp.promote_types(jnp.result_type(lhs, rhs), jnp.float32)
  out = jnp.zeros((lhs.shape[0], rhs.shape[2]), compute)
  lhs32 = lhs.astype(compute)
  for j in range(rhs.shape[0]):
    g = offset + j
    gc = jnp.clip(g, 0, num_groups - 1)
    in_group = (g >= 0) & (g < num_groups) & (rows >= starts[gc]) & (rows < ends[gc])
    prod = jnp.matmul(lhs32, rhs[j].astype(compute), precision=jax.lax.Precision.HIGHEST)
    out = out + jnp.where(in_group, prod, 0.0)
  return out.astype(out_dtype)


# ------------------------------------------------------------------------------------------------
# The "ragged_dot" backend: jax.lax.ragged_dot, with a vmap rule it lacks.


def _ragged_dot_raw(lhs, rhs, group_sizes, *, precision, out_dtype):
  out = jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                           preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


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


@functools.lru_cache(maxsize=None)
def _ragged_dot_ops(precision, out_dtype):
  raw = functools.partial(_ragged_dot_raw, precision=precision, out_dtype=out_dtype)

  def raw_vjp(lhs, rhs, group_sizes, ct):
    # The transposed products in the inputs' own dtype (as a plain dot's backward), not float32:
    # bf16 inputs keep bf16 gradient matmuls, which still accumulate in float32 inside.
    compute = jnp.result_type(lhs, rhs)
    dot = lambda a, b: jax.lax.ragged_dot(a, b, group_sizes, precision=precision)
    _, vjp = jax.vjp(dot, lhs, rhs)
    return vjp(ct.astype(compute))

  return _vmap_all_batched(raw), _vmap_all_batched(raw_vjp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ragged_dot(lhs, rhs, group_sizes, precision, out_dtype):
  return _ragged_dot_ops(precision, out_dtype)[0](lhs, rhs, group_sizes)


def _ragged_dot_fwd(lhs, rhs, group_sizes, precision, out_dtype):
  return _ragged_dot(lhs, rhs, group_sizes, precision, out_dtype), (lhs, rhs, group_sizes)


def _ragged_dot_bwd(precision, out_dtype, res, ct):
  lhs, rhs, group_sizes = res
  d_lhs, d_rhs = _ragged_dot_ops(precision, out_dtype)[1](lhs, rhs, group_sizes, ct)
  return d_lhs, d_rhs, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def _grouped_matmul_from_zero(lhs, rhs, group_sizes, impl, precision, out_dtype):
  """The backends proper: rhs[g] for group g of group_sizes, groups starting at row 0."""
  if impl == "reference":
    return grouped_matmul_reference(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
  if impl == "ragged_dot":
    return _ragged_dot(lhs, rhs, group_sizes, precision, out_dtype)
  from sparsejax.kernels import gmm  # the GPU kernels live beside their references

  # The kernels take one input dtype: mixed inputs meet at the promoted one, as XLA's dot does.
  compute = jnp.result_type(lhs, rhs)
  return gmm.grouped_matmul_padded(lhs.astype(compute), rhs.astype(compute), group_sizes,
                                   backend=kernel_backend(impl), out_dtype=out_dtype)


def grouped_matmul(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "groups k n"],
    group_sizes: Int[Array, "all_groups"],
    *,
    precision=None,
    preferred_element_type=None,
    group_offset: Int[Array, ""] | None = None,
    impl: str = "auto",
) -> Float[Array, "rows n"]:
  """out[i] = lhs[i] @ rhs[g] for rows i in group g (groups are consecutive row blocks), zero past them.

  A drop-in for `jax.lax.ragged_dot`, on every impl ("reference", "ragged_dot", "pallas" / "mosaic"
  / "triton" (the Pallas GPU kernels; interpret mode off the GPU) or "auto"):
  - accumulates in float32 and returns preferred_element_type (default: the promoted dtype of lhs
    and rhs, which may differ, e.g. bf16 activations with float32 weights);
  - precision: as jax.lax.dot's; None means full float32 precision when an operand is float32
    (not XLA's TF32 default on GPU) and the backend default otherwise. The reference and the
    Pallas kernels always compute at full precision for their input dtype.
  - group_offset ([] or [1] int): rhs holds the groups group_offset .. group_offset + rhs.shape[0] - 1
    of group_sizes (which may list more groups, e.g. all experts when rhs is one device's shard);
    only their rows are computed, with rhs[g - group_offset]; every other row is zero (megablox's
    meaning). A concrete offset must keep that range inside group_sizes; a traced one past it
    computes the groups that exist.
  Differentiable in lhs and rhs (gradients in their dtypes).
  """
  group_sizes = jnp.asarray(group_sizes)
  if group_offset is not None and not isinstance(group_offset, jax.Array):
    group_offset = jnp.asarray(group_offset)
  check_grouped_matmul_args(lhs, rhs, group_sizes, group_offset, preferred_element_type)
  impl = resolve_impl(impl, jnp.result_type(lhs, rhs))
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
  precision = full_precision(precision, lhs, rhs)
  group_sizes = group_sizes.astype(jnp.int32)
  if group_offset is None:
    return _grouped_matmul_from_zero(lhs, rhs, group_sizes, impl, precision, out_dtype)
  offset = jnp.reshape(group_offset, ()).astype(jnp.int32)
  if impl == "reference":
    return grouped_matmul_reference(lhs, rhs, group_sizes, preferred_element_type=out_dtype,
                                    group_offset=offset)
  # Every other backend computes groups that start at row 0: rotate the selected groups' rows to
  # the top, run it on their sizes alone, and rotate back. Rows it leaves zero (past the selected
  # groups) land outside their range, so the other rows stay zero.
  local, start = _local_group_sizes(group_sizes, offset, rhs.shape[0])
  rows = lhs.shape[0]
  ends = jnp.minimum(jnp.cumsum(local), jnp.maximum(rows - start, 0))  # sum(group_sizes) <= rows
  local = ends - jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
  shift = jnp.minimum(start, rows)
  out = _grouped_matmul_from_zero(jnp.roll(lhs, -shift, axis=0), rhs, local, impl, precision,
                                  out_dtype)
  return jnp.roll(out, shift, axis=0)
