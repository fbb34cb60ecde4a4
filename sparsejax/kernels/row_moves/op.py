"""gather_rows: the MoE layer's forward row move, out[r] = x[src[r]] (zero where src[r] == len(x)).

src holds indices in [0, n], n = len(x) meaning "no row" (a padding row of the expert buffer).
Backends: "triton" (triton.py; off the GPU in interpret mode) and "xla" (reference.py); "auto" takes
triton on a GPU when the kernel takes the width (triton.block_d_for), where this jax has Pallas'
Triton backend. Differentiable in x: the cotangent is the transpose of the gather, dx[t] = sum over r
with src[r] = t of dout[r] (a segment sum; permute.gather_rows has a cheaper one that knows each
token's rows).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax import _checks
from sparsejax.kernels import auto_takes_triton, require_triton
from sparsejax.kernels.row_moves import triton
from sparsejax.kernels.row_moves.reference import gather_rows_reference

IMPLS = ("auto", "triton", "xla")


def runs_kernel(d: int, impl: str = "auto") -> bool:
  """Whether gather_rows runs the Pallas kernel for rows of width d: impl "triton", or "auto" on a
  GPU when the kernel takes the width and this jax has Pallas' Triton backend."""
  if impl == "triton":
    return True
  return impl == "auto" and jax.default_backend() == "gpu" and triton.block_d_for(d) is not None and auto_takes_triton()


def _check(x, src, impl):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  if impl == "triton":
    require_triton("gather_rows(impl='triton')")
  _checks.check_rank("x", x, 2, "[n, d]")
  _checks.check_rank("src", src, 1, "[rows]")
  _checks.check_integer("src", src)
  if impl == "triton" and triton.block_d_for(x.shape[1]) is None:
    raise ValueError(f"impl='triton' needs d a multiple of {triton.Config().block_d} or a smaller power "
                     f"of two; got d={x.shape[1]} (use impl='auto').")


@jax.custom_vjp
def _kernel(x, src):
  return triton.gather_rows(x, src.astype(jnp.int32), interpret=jax.default_backend() != "gpu")


def _kernel_fwd(x, src):
  return _kernel(x, src), (src, x.shape[0])


def _kernel_bwd(res, g):
  src, n = res
  dx = jnp.zeros((n, g.shape[1]), jnp.float32).at[src].add(g.astype(jnp.float32), mode="drop")
  return dx.astype(g.dtype), None


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def gather_rows(
    x: Float[Array, "n d"], src: Int[Array, "rows"], *, impl: str = "auto"
) -> Float[Array, "rows d"]:
  """out[r] = x[src[r]], zero where src[r] == n = len(x); src in [0, n] (module doc)."""
  _check(x, src, impl)
  if src.shape[0] and x.shape[1] and runs_kernel(x.shape[1], impl):
    return _kernel(x, src)
  return gather_rows_reference(x, src)
