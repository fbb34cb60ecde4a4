"""residual_norm: a decode step's glue between two layers, as one op.

  h = round(x + pending_delta(parts, combine))      the layer output added to the residual stream
  n = h / sqrt(mean(h^2) + eps) * scale             the next layer's RMSNorm, in float32, rounded
  with w_router: logits = n W_r (float32), p = softmax(logits), ids = its k largest, weights = p[ids]
                 (/ their sum if renormalize): routing.top_k_routing of the MoE layer that reads n
parts are the previous layer's split-K partial products (skinny_matmul_parts: [slots, splits, rows >= m,
d] float32) and combine [m, slots] its MoE combine weights; the rounding follows the unfused layers
(reference.pending_delta), so both backends give the unfused model's numbers. parts=None: h = x.
Backends: "triton" (triton.py; off the GPU in interpret mode) and "xla" (reference.py); "auto" takes
triton on a GPU when d has a power-of-two block >= 16 and E is a power of two. Differentiable: the
cotangents are the reference's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from sparsejax import _checks
from sparsejax.kernels.residual_norm import triton
from sparsejax.kernels.residual_norm.reference import residual_norm_reference

IMPLS = ("auto", "triton", "xla")


def _kernel_fits(d: int, w_router) -> bool:
  e = None if w_router is None else w_router.shape[1]
  return triton.block_size(d) is not None and (e is None or e & (e - 1) == 0)


def _check(x, parts, combine, scale, w_router, k, impl):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  _checks.check_rank("x", x, 2, "[rows, d]")
  _checks.check_floating("x", x)
  m, d = x.shape
  if scale.shape != (d,):
    raise ValueError(f"scale must have shape ({d},) for x of shape {x.shape}; got {scale.shape}.")
  if parts is not None:
    _checks.check_rank("parts", parts, 4, "[slots, splits, rows, d]")
    if parts.dtype != jnp.float32 or parts.shape[2] < m or parts.shape[3] != d:
      raise ValueError(f"parts must be float32 [slots, splits, rows >= {m}, {d}]; got {parts.dtype} {parts.shape}.")
    if combine is not None and combine.shape != (m, parts.shape[0]):
      raise ValueError(f"combine must be [rows, slots] = {(m, parts.shape[0])}; got {combine.shape}.")
    if combine is None and parts.shape[0] != 1:
      raise ValueError(f"parts of {parts.shape[0]} slots need combine, their [rows, slots] weights.")
  elif combine is not None:
    raise ValueError("combine weighs parts' slots: give parts too.")
  if w_router is not None:
    _checks.check_rank("w_router", w_router, 2, "[d, experts]")
    if w_router.shape[0] != d:
      raise ValueError(f"w_router must be [{d}, experts]; got {w_router.shape}.")
    _checks.check_top_k(k, w_router.shape[1])
  if impl == "triton" and not _kernel_fits(d, w_router):
    raise ValueError(f"impl='triton' needs d a multiple of 16 and a power-of-two number of experts; got d={d}"
                     f"{'' if w_router is None else f', {w_router.shape[1]} experts'} (use impl='auto').")


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _kernel(x, parts, combine, scale, w_router, eps, k, renormalize):
  return triton.residual_norm(x, parts, combine, scale, w_router, eps=eps, k=k, renormalize=renormalize,
                              interpret=jax.default_backend() != "gpu")


def _kernel_fwd(x, parts, combine, scale, w_router, eps, k, renormalize):
  return _kernel(x, parts, combine, scale, w_router, eps, k, renormalize), (x, parts, combine, scale, w_router)


def _kernel_bwd(eps, k, renormalize, res, g):
  ref = lambda *a: residual_norm_reference(*a[:4], eps=eps, w_router=a[4], k=k, renormalize=renormalize)
  _, vjp = jax.vjp(ref, *res)
  return vjp(g)


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def residual_norm(
    x: Float[Array, "m d"],
    parts: Float[Array, "slots splits rows d"] | None,
    combine: Float[Array, "m slots"] | None,
    scale: Float[Array, "d"],
    *,
    eps: float,
    w_router: Float[Array, "d experts"] | None = None,
    k: int = 1,
    renormalize: bool = False,
    impl: str = "auto",
) -> tuple:
  """(h, n), or (h, n, logits, ids, weights) with w_router (module doc)."""
  _check(x, parts, combine, scale, w_router, k, impl)
  if impl == "triton" or (impl == "auto" and jax.default_backend() == "gpu" and _kernel_fits(x.shape[1], w_router)):
    return _kernel(x, parts, combine, scale, w_router, float(eps), int(k), bool(renormalize))
  return residual_norm_reference(x, parts, combine, scale, eps=eps, w_router=w_router, k=k, renormalize=renormalize)
