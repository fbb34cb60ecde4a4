"""skinny_matmul: a product of a few rows (decoding) with a weight, or with chosen experts' weights.

  w [k, n]:               y[r]    = x[r] @ w, r over x's leading axes          (* scale[n])
  w [e, k, n], experts:   y[s, m] = x_s[m] @ w[experts[s]]   (* scale[experts[s], n])
with x_s = x (shared, [m, k]) or x[s] ([slots, m, k]); the result is float32. Weights enter the product
as x's dtype, cast where they are loaded: int8 exactly (|q| <= 127), with the per-column scale on the
float32 result, so no dequantized (or float32-to-bf16) copy of a weight is ever written. Only the
chosen experts' weights are read.
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

IMPLS = ("auto", "triton", "xla")
# Rows the kernel takes: it pads them to a power of two >= 16, one tensor-core tile of rows at most 64.
MAX_ROWS = 64


def _check(x, w, experts, scale, impl):
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
  if impl == "triton":
    m = x.size // x.shape[-1] if w.ndim == 2 else x.shape[-2]
    if m > MAX_ROWS:
      raise ValueError(f"impl='triton' takes at most {MAX_ROWS} rows; got m={m} (use impl='auto').")
    if triton.default_config(m, k, n) is None:
      raise ValueError(f"impl='triton' needs k and n multiples of 16; got k={k}, n={n} (use impl='auto').")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel(x, w, experts, cfg):
  return triton.skinny_matmul(x, w, experts, cfg, interpret=jax.default_backend() != "gpu")


def _kernel_fwd(x, w, experts, cfg):
  return _kernel(x, w, experts, cfg), (x, w, experts)


def _kernel_bwd(cfg, res, g):
  del cfg
  x, w, experts = res
  x3 = x if x.ndim == 3 else jnp.broadcast_to(x, (experts.shape[0],) + x.shape)
  _, vjp = jax.vjp(lambda x3, w, e: skinny_matmul_reference(x3, w, e), x3, w, experts)
  dx, dw, de = vjp(g)
  if x.ndim == 2:
    dx = dx.sum(axis=0)
  return dx.astype(x.dtype), dw, de


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def skinny_matmul(
    x: Float[Array, "*m k"] | Float[Array, "slots m k"],
    w: Num[Array, "k n"] | Num[Array, "experts k n"],
    *,
    experts: Int[Array, "slots"] | None = None,
    scale: Float[Array, "n"] | Float[Array, "experts n"] | None = None,
    impl: str = "auto",
) -> Float[Array, "*m n"] | Float[Array, "slots m n"]:
  """y = x @ w, or y[s] = x_s @ w[experts[s]], times the per-column scale; float32 (see the module doc).
  With w [k, n], x's leading dimensions are rows, as in jnp.dot."""
  _check(x, w, experts, scale, impl)
  dense = w.ndim == 2
  if dense and x.ndim != 2:
    lead = x.shape[:-1]
    y = skinny_matmul(x.reshape(-1, x.shape[-1]), w, scale=scale, impl=impl)
    return y.reshape(*lead, w.shape[-1])
  w3 = w[None] if dense else w
  ids = jnp.zeros((1,), jnp.int32) if dense else experts.astype(jnp.int32)
  m, k = x.shape[-2:]
  n = w.shape[-1]
  cfg = triton.default_config(m, k, n)
  use_kernel = impl == "triton" or (impl == "auto" and jax.default_backend() == "gpu" and cfg is not None
                                    and m <= MAX_ROWS)
  if use_kernel:
    y = _kernel(x, w3, ids, cfg)
  elif dense:  # a plain dot: no gather of the one weight
    y = jnp.dot(x, w.astype(x.dtype), precision=dot_precision(x.dtype), preferred_element_type=jnp.float32)[None]
  else:
    x3 = x if x.ndim == 3 else jnp.broadcast_to(x, (ids.shape[0],) + x.shape)
    y = skinny_matmul_reference(x3, w3, ids)
  if scale is not None:
    s = scale[None] if dense else jnp.take(scale, ids, axis=0)
    y = y * s.astype(jnp.float32)[:, None, :]
  return y[0] if dense else y
