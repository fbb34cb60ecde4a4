"""decode_router: top-k routing of a few tokens in Pallas kernels (a decode step's router).

  logits = float32(x) W_r; ids = the k largest logits per token, largest first, the lower expert first
  among equal ones; weights = softmax(logits)[ids], divided by their sum when renormalize
This is routing.top_k_routing(routing.router_logits(x, W_r), k, renormalize) without jitter (softmax is
monotone, so the k largest logits are the k largest p): the ids equal it wherever no two probabilities are
within the logits' float32 rounding of each other, and the weights agree to float32 rounding. The ids are
taken from the logits, by comparisons only, so that every kernel selecting from the same partial logits
(router_logit_parts: the experts' row kernel and its epilogue do at one token) gets the same ids.
Backends: "triton" (triton.py; off the GPU in interpret mode)
and "xla" (reference.py); "auto" takes triton on a GPU for at most MAX_TOKENS tokens when the kernel
fits (kernel_fits) and W_r splits over several programs or is one tile (the one-program form of a
longer W_r is not measured faster than XLA), where this jax has Pallas' Triton backend.
Differentiable in x and W_r through the weights: the cotangents are the reference's.
norm = (g, eps) routes rms_norm(x, g, eps) (sparsejax.norm) instead of x: a decode step's RMSNorm
then runs inside the kernel's programs (triton.norm_fits) instead of as XLA kernels of its own.
NaN logits are not supported: their order is unspecified.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax import _checks
from sparsejax.kernels import auto_takes_triton, require_triton
from sparsejax.kernels._reference_vjp import with_reference_vjp
from sparsejax.kernels.decode_router import triton
from sparsejax.kernels.decode_router.reference import (decode_router_reference, logit_parts_reference,
                                                       select_from_parts)
from sparsejax.norm import rms_norm
from sparsejax.top_k import MAX_PASSES_K

IMPLS = ("auto", "triton", "xla")
# Each token's programs read all of W_r: past a decode batch, XLA's product over all tokens is cheaper.
MAX_TOKENS = 64


def kernel_fits(d_model: int, num_experts: int, k: int) -> bool:
  """The kernel's shapes: E a power of two (Triton blocks), k <= MAX_PASSES_K, d_model a multiple of 16."""
  return (num_experts & (num_experts - 1) == 0 and k <= MAX_PASSES_K
          and triton.default_config(d_model, num_experts) is not None)


def _check(x, w_router, k, impl, norm):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  if impl == "triton":
    require_triton("decode_router(impl='triton')")
  _checks.check_router(x, w_router)
  if norm is not None:
    _checks.check_floating("norm scale", norm[0])
    if norm[0].shape != (x.shape[1],):
      raise ValueError(f"the norm's scale must have shape ({x.shape[1]},) (one per column of x); "
                       f"got {norm[0].shape}.")
  _checks.check_top_k(k, w_router.shape[1])
  if impl == "triton" and not kernel_fits(x.shape[1], w_router.shape[1], k):
    raise ValueError(f"impl='triton' needs a power-of-two expert count, k <= {MAX_PASSES_K} and d_model a "
                     f"multiple of 16; got {w_router.shape[1]} experts, k={k}, d_model={x.shape[1]} "
                     "(use impl='auto').")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _kernel(x, w_router, norm_scale, k, renormalize, eps):
  cfg = triton.default_config(x.shape[1], w_router.shape[1])
  norm = None if norm_scale is None else (norm_scale, eps)
  return triton.decode_router(x, w_router, k, renormalize, cfg, interpret=jax.default_backend() != "gpu",
                              norm=norm)


def _kernel_fwd(x, w_router, norm_scale, k, renormalize, eps):
  return _kernel(x, w_router, norm_scale, k, renormalize, eps), (x, w_router, norm_scale)


def _kernel_bwd(k, renormalize, eps, res, g):
  def ref(x, w, ns):
    return decode_router_reference(x if ns is None else rms_norm(x, ns, eps), w, k, renormalize)[1]

  _, vjp = jax.vjp(ref, *res)
  return vjp(g[1])


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def runs_kernel(num_tokens: int, d_model: int, num_experts: int, k: int, impl: str = "auto") -> bool:
  """Whether decode_router runs the Pallas kernels for these shapes (else the reference): impl
  "triton", or "auto" on a GPU for 1..MAX_TOKENS tokens when the kernel fits and W_r splits over
  several programs or is one tile, where this jax has Pallas' Triton backend."""
  if num_tokens == 0:  # no programs to launch; the reference returns the empty answer
    return False
  if impl == "triton":
    return True
  cfg = triton.default_config(d_model, num_experts)
  return (impl == "auto" and jax.default_backend() == "gpu" and num_tokens <= MAX_TOKENS
          and kernel_fits(d_model, num_experts, k) and (cfg.splits > 1 or cfg.block_k == d_model)
          and auto_takes_triton())


def decode_router(
    x: Float[Array, "tokens d_model"],
    w_router: Float[Array, "d_model experts"],
    k: int,
    *,
    renormalize: bool | None = None,
    norm: tuple[Float[Array, "d_model"], float] | None = None,
    impl: str = "auto",
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
  """(expert ids int32, combine weights float32) of the k largest softmax(x W_r) per token (module doc).
  renormalize=None means "k > 1", as in routing.top_k_routing. norm = (g, eps): of rms_norm(x, g, eps)."""
  _check(x, w_router, k, impl, norm)
  renormalize = k > 1 if renormalize is None else bool(renormalize)
  kernel = runs_kernel(x.shape[0], x.shape[1], w_router.shape[1], k, impl)
  if norm is not None and not (kernel and triton.norm_fits(x.shape[1])):
    x, norm = rms_norm(x, *norm), None
  if kernel:
    return _kernel(x, w_router, None if norm is None else norm[0], k, renormalize,
                   None if norm is None else float(norm[1]))
  return decode_router_reference(x, w_router, k, renormalize)


def splits_logits(num_tokens: int, d_model: int, num_experts: int, k: int, impl: str = "auto") -> bool:
  """Whether decode_router runs its two-kernel form here (runs_kernel, W_r over several programs): then
  router_logit_parts is its first kernel, and a kernel after it can select for itself."""
  return runs_kernel(num_tokens, d_model, num_experts, k, impl) and triton.default_config(d_model, num_experts).splits > 1


def router_logit_parts(
    x: Float[Array, "tokens d_model"],
    w_router: Float[Array, "d_model experts"],
    *,
    norm: tuple[Float[Array, "d_model"], float] | None = None,
    pending: Float[Array, "p rows d_model"] | None = None,
) -> Float[Array, "tokens splits experts"] | tuple[Float[Array, "tokens splits experts"], Float[Array, "tokens d_model"]]:
  """decode_router's first kernel alone: float32 partial logits, sum_s parts[:, s] = float32(xn) W_r, xn = x or
  rms_norm(x, g, eps) (norm = (g, eps), taken in the kernel where triton.norm_fits). For a consumer kernel that
  sums them in split order and selects as decode_router does (triton.summed_logits, top_ids, weights_of;
  reference: reference.select_from_parts), so that no kernel of its own runs between the router and it.
  pending: the split-K parts of a product the block adds to x first (skinny_matmul.split_k_parts, rows >= tokens):
  x is then h = round(x + round(sum_p pending[p, :tokens])), as x + product.astype(x.dtype) rounds it, and the result
  is (parts, h): the add runs in the router's programs instead of as an XLA kernel before them (it needs norm, with
  triton.norm_fits, else XLA adds first). Only where splits_logits holds (or off the GPU, in interpret mode).
  Differentiable: the reference's cotangents."""
  require_triton("router_logit_parts", "it only where decode_router.splits_logits holds")
  _check(x, w_router, 1, "triton", norm)
  cfg = triton.default_config(x.shape[1], w_router.shape[1])
  if cfg.splits < 2:
    raise ValueError(f"router_logit_parts needs W_r over several programs; d_model={x.shape[1]} with "
                     f"{w_router.shape[1]} experts runs in one (decode_router's one-kernel form).")
  if pending is not None:
    _checks.check_floating("pending", pending)
    if pending.ndim != 3 or pending.shape[1] < x.shape[0] or pending.shape[2] != x.shape[1]:
      raise ValueError(f"pending must be [parts, rows >= {x.shape[0]}, {x.shape[1]}] (a product's split-K parts); "
                       f"got {pending.shape}.")
    if norm is None or not triton.norm_fits(x.shape[1]):
      h = _added(x, pending)
      return router_logit_parts(h, w_router, norm=norm), h
  if norm is not None and not triton.norm_fits(x.shape[1]):
    x, norm = rms_norm(x, *norm), None
  eps = None if norm is None else float(norm[1])
  interpret = jax.default_backend() != "gpu"

  def kernel(x, w, ns, pend):
    return triton.logit_parts(x, w, cfg, interpret=interpret, norm=None if ns is None else (ns, eps), pending=pend)

  def reference(x, w, ns, pend):
    h = x if pend is None else _added(x, pend)
    parts = logit_parts_reference(h if ns is None else rms_norm(h, ns, eps), w, cfg.splits)
    return parts if pend is None else (parts, h)

  return with_reference_vjp(kernel, reference, x, w_router, None if norm is None else norm[0], pending)


def select_logit_parts(
    parts: Float[Array, "tokens splits experts"],
    k: int,
    *,
    renormalize: bool | None = None,
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
  """decode_router's second kernel alone: (ids, weights) of router_logit_parts' partial logits, decode_router's
  rule (reference.select_from_parts). renormalize=None means "k > 1". A kernel on a GPU (interpret mode off it;
  the reference where the kernel does not fit or this jax has no Pallas Triton backend); differentiable through
  the weights: the reference's cotangents."""
  _checks.check_floating("parts", parts)
  if parts.ndim != 3:
    raise ValueError(f"parts must be [tokens, splits, experts] (router_logit_parts'); got shape {parts.shape}.")
  _checks.check_top_k(k, parts.shape[2])
  renormalize = k > 1 if renormalize is None else bool(renormalize)
  t, splits, e = parts.shape
  if t == 0 or splits & (splits - 1) or e & (e - 1) or k > MAX_PASSES_K or not auto_takes_triton():
    return select_from_parts(parts, k, renormalize)
  kernel = lambda p: triton.select(p, k, renormalize, interpret=jax.default_backend() != "gpu")
  return with_reference_vjp(kernel, lambda p: select_from_parts(p, k, renormalize), parts)


def _added(x, pending):
  """x + (the parts' sum, rounded to x's dtype), in x's dtype: the block's residual add of the product."""
  y = jnp.sum(pending, axis=0)[:x.shape[0]].astype(x.dtype)
  return (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)
