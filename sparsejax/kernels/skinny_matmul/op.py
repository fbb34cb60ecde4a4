"""skinny_matmul: a product of a few rows (decoding) with a weight, or with chosen experts' weights.

  w [k, n]:               y[r]    = x[r] @ w, r over x's leading axes          (* scale[n])
  w [e, k, n], experts:   y[s, m] = x_s[m] @ w[experts[s]]   (* scale[experts[s], n])
with x_s = x (shared, [m, k]) or x[s] ([slots, m, k]); the result is float32. Weights enter the
product as x's dtype, cast where they are loaded: int8 exactly (|q| <= 127), with the per-column
scale on the float32 result, so no dequantized (or float32-to-bf16) copy of a weight is ever
written. Only the chosen experts' weights are read.
norm = (g, eps) puts sparsejax.norm.rms_norm(x, g, eps) in x's place (a shared x only): a decode
step's RMSNorm then runs inside the product's programs (folds_norm) instead of as kernels of its
own, within x's dtype rounding of the reference (which rounds the normalized x; the kernel x * g).
Backends: "triton" (triton.py; off the GPU in interpret mode) and "xla" (reference.py, an einsum);
"auto" takes triton on a GPU when m <= MAX_ROWS and k, n are multiples of 16. Differentiable: the
cotangents are the reference's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Num

from sparsejax import _checks
from sparsejax._precision import dot_precision
from sparsejax.kernels.skinny_matmul import triton
from sparsejax.kernels.skinny_matmul.reference import skinny_matmul_reference
from sparsejax.norm import rms_norm

IMPLS = ("auto", "triton", "xla")
# Rows the kernel takes: it pads them to a power of two >= 16, one tensor-core tile of rows at most 64.
MAX_ROWS = 64


def _check(x, w, experts, scale, norm, impl):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  _checks.check_floating("x", x)
  if w.ndim not in (2, 3):
    raise ValueError(f"w must be [k, n] or [experts, k, n]; got shape {w.shape}.")
  if w.ndim == 2:
    if experts is not None:
      raise ValueError("experts selects from w [experts, k, n]; w is [k, n].")
    if x.ndim < 1:
      raise ValueError("x must be [..., k] for w [k, n]; got a scalar.")
  else:
    if experts is None:
      raise ValueError(f"w is [experts, k, n] = {w.shape}: give experts, the [slots] expert ids to read.")
    _checks.check_rank("experts", experts, 1, "[slots]")
    _checks.check_integer("experts", experts)
    if x.ndim not in (2, 3):
      raise ValueError(f"x must be [m, k] (shared by every slot) or [slots, m, k]; got shape {x.shape}.")
    if x.ndim == 3 and x.shape[0] != experts.shape[0]:
      raise ValueError(f"x is [slots={x.shape[0]}, m, k] but experts has {experts.shape[0]} slots.")
  k, n = w.shape[-2:]
  if x.shape[-1] != k:
    raise ValueError(f"x has k={x.shape[-1]} but w is {'[e, ' if w.ndim == 3 else '['}{k}, {n}].")
  if jnp.result_type(w) == jnp.int8:
    if scale is None:
      raise ValueError("int8 w needs scale, its per-output-column float scales.")
  else:
    _checks.check_floating("w", w)
  if scale is not None:
    _checks.check_floating("scale", scale)
    want = (n,) if w.ndim == 2 else (w.shape[0], n)
    if scale.shape != want:
      raise ValueError(f"scale must have shape {want} (one per output column{' per expert' if w.ndim == 3 else ''}); "
                       f"got {scale.shape}.")
  if norm is not None:
    if w.ndim == 3 and x.ndim == 3:
      raise ValueError("norm applies to a shared x ([m, k] or [..., k]), not to per-slot rows [slots, m, k].")
    _checks.check_floating("norm scale", norm[0])
    if norm[0].shape != (k,):
      raise ValueError(f"the norm's scale must have shape ({k},) (one per column of x); got {norm[0].shape}.")
  if impl == "triton":
    m = x.size // x.shape[-1] if w.ndim == 2 else x.shape[-2]
    if m > MAX_ROWS:
      raise ValueError(f"impl='triton' takes at most {MAX_ROWS} rows; got m={m} (use impl='auto').")
    if triton.default_config(m, k, n) is None:
      raise ValueError(f"impl='triton' needs k and n multiples of 16; got k={k}, n={n} (use impl='auto').")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _kernel(x, w, experts, norm_scale, cfg, eps):
  norm = None if norm_scale is None else (norm_scale, eps)
  return triton.skinny_matmul(x, w, experts, cfg, interpret=jax.default_backend() != "gpu", norm=norm)


def _kernel_fwd(x, w, experts, norm_scale, cfg, eps):
  return _kernel(x, w, experts, norm_scale, cfg, eps), (x, w, experts, norm_scale)


def _kernel_bwd(cfg, eps, res, g):
  del cfg
  x, w, experts, norm_scale = res

  def ref(x, w, e, ns):
    xn = x if ns is None else rms_norm(x, ns, eps)
    x3 = xn if xn.ndim == 3 else jnp.broadcast_to(xn, (e.shape[0],) + xn.shape)
    return skinny_matmul_reference(x3, w, e)

  _, vjp = jax.vjp(ref, x, w, experts, norm_scale)
  dx, dw, de, dns = vjp(g)
  return dx.astype(x.dtype), dw, de, dns


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def runs_kernel(m: int, k: int, n: int, impl: str = "auto") -> bool:
  """Whether skinny_matmul of m rows by a [k, n] weight runs the Pallas kernel (else XLA): impl
  "triton", or "auto" on a GPU for at most MAX_ROWS rows when the kernel has tiles for k and n."""
  return impl == "triton" or (impl == "auto" and jax.default_backend() == "gpu" and m <= MAX_ROWS
                              and triton.default_config(m, k, n) is not None)


def folds_norm(m: int, k: int, n: int, impl: str = "auto") -> bool:
  """Whether skinny_matmul(x [m, k], w [.., k, n], norm=...) takes the norm inside its kernel (else
  XLA's kernels normalize x first): where the kernel runs and the rows are small (triton.norm_fits)."""
  return runs_kernel(m, k, n, impl) and triton.norm_fits(m, k)


def skinny_matmul(
    x: Float[Array, "*m k"] | Float[Array, "slots m k"],
    w: Num[Array, "k n"] | Num[Array, "experts k n"],
    *,
    experts: Int[Array, "slots"] | None = None,
    scale: Float[Array, "n"] | Float[Array, "experts n"] | None = None,
    norm: tuple[Float[Array, "k"], float] | None = None,
    impl: str = "auto",
) -> Float[Array, "*m n"] | Float[Array, "slots m n"]:
  """y = x @ w, or y[s] = x_s @ w[experts[s]], times the per-column scale; float32 (see the module doc).
  With w [k, n], x's leading dimensions are rows, as in jnp.dot. norm = (g, eps): x is first
  RMS-normalized with scale g (in the kernel's programs where it runs)."""
  _check(x, w, experts, scale, norm, impl)
  dense = w.ndim == 2
  if dense and x.ndim != 2:
    lead = x.shape[:-1]
    y = skinny_matmul(x.reshape(-1, x.shape[-1]), w, scale=scale, norm=norm, impl=impl)
    return y.reshape(*lead, w.shape[-1])
  w3 = w[None] if dense else w
  ids = jnp.zeros((1,), jnp.int32) if dense else experts.astype(jnp.int32)
  m, k = x.shape[-2:]
  n = w.shape[-1]
  if norm is not None and not folds_norm(m, k, n, impl):
    x, norm = rms_norm(x, *norm), None  # XLA's two kernels for the norm, then the product
  if runs_kernel(m, k, n, impl):
    cfg = triton.default_config(m, k, n)
    y = _kernel(x, w3, ids, None if norm is None else norm[0], cfg, None if norm is None else float(norm[1]))
  elif dense:  # a plain dot: no gather of the one weight
    y = jnp.dot(x, w.astype(x.dtype), precision=dot_precision(x.dtype), preferred_element_type=jnp.float32)[None]
  else:
    x3 = x if x.ndim == 3 else jnp.broadcast_to(x, (ids.shape[0],) + x.shape)
    y = skinny_matmul_reference(x3, w3, ids)
  if scale is not None:
    s = scale[None] if dense else jnp.take(scale, ids, axis=0)
    y = y * s.astype(jnp.float32)[:, None, :]
  return y[0] if dense else y
