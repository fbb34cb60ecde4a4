"""decode_qkv: a decode step's qkv projection, given as split-K parts, into its query and cache slot.

  qkv[b] = sum_p parts[p, b] (rounded to dtype) as [3, h, dh];  pos_b = index - start[b]
  q[b] = RoPE(qkv[b, 0], pos_b);  k_cache[b, i] = RoPE(qkv[b, 1], pos_b);  v_cache[b, i] = qkv[b, 2]
with i = min(index, slots - 1): RoPE as sparsejax.rope.rotary, the write as inference.kv_cache.write (one
new token a row; its dynamic_update_slice clamps a write past the end onto the last slot). Backends:
"triton" (triton.py; off the GPU in interpret mode) and "xla" (reference.py); "auto" takes triton on a
GPU when dh / 2 is a power of two. Differentiable: the cotangents are the reference's.

decode_qkv_product: the same from one row x and W_qkv (the norm optionally folded), qkv = norm(x) W_qkv
rounded to dtype; its kernel (triton_product.py) computes the product too, so the step runs one kernel
where decode_qkv needs skinny_matmul's split-K kernel before it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax import _checks
from sparsejax.kernels._reference_vjp import with_reference_vjp
from sparsejax.kernels.decode_qkv import triton, triton_product
from sparsejax.kernels.decode_qkv.reference import decode_qkv_product_reference, decode_qkv_reference
from sparsejax.rope import inverse_frequencies

IMPLS = ("auto", "triton", "xla")


def _kernel_fits(dh: int) -> bool:
  half = dh // 2
  return dh % 2 == 0 and half & (half - 1) == 0


def runs_kernel(dh: int, impl: str = "auto") -> bool:
  """Whether decode_qkv runs the Pallas kernel (else XLA's kernels): impl "triton", or "auto" on a GPU
  for a head_dim whose halves are powers of two (Triton's vectors)."""
  return impl == "triton" or (impl == "auto" and jax.default_backend() == "gpu" and _kernel_fits(dh))


def _check(parts, k_cache, v_cache, index, start, impl):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  _checks.check_rank("parts", parts, 3, "[splits, rows, 3 * heads * head_dim]")
  _checks.check_floating("parts", parts)
  _checks.check_rank("k_cache", k_cache, 4, "[batch, slots, heads, head_dim]")
  if k_cache.shape != v_cache.shape:
    raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must have one shape.")
  b, _, h, dh = k_cache.shape
  if parts.shape[1] < b or parts.shape[2] != 3 * h * dh:
    raise ValueError(f"parts must be [splits, rows >= {b}, 3 * {h} * {dh} = {3 * h * dh}] for this cache; "
                     f"got {parts.shape}.")
  _checks.check_rank("index", index, 0, "[] (the new token's slot)")
  _checks.check_integer("index", index)
  _checks.check_rank("start", start, 1, "[batch]")
  _checks.check_integer("start", start)
  if start.shape[0] != b:
    raise ValueError(f"start must have one entry per row ({b}); got {start.shape[0]}.")
  if impl == "triton" and not _kernel_fits(dh):
    raise ValueError(f"impl='triton' needs head_dim / 2 a power of two; got head_dim {dh} (use impl='auto').")


def decode_qkv(
    parts: Float[Array, "splits rows three_h_dh"],
    k_cache: Float[Array, "b s h dh"],
    v_cache: Float[Array, "b s h dh"],
    index: Int[Array, ""],
    start: Int[Array, "b"],
    *,
    rope_base: float,
    dtype,
    impl: str = "auto",
) -> tuple[Float[Array, "b h dh"], Float[Array, "b s h dh"], Float[Array, "b s h dh"]]:
  """(q [b, h, dh] in dtype, k_cache, v_cache with slot `index` written): the module doc's math."""
  index = jnp.asarray(index)
  _check(parts, k_cache, v_cache, index, start, impl)
  reference = lambda *a: decode_qkv_reference(*a, rope_base, dtype)
  if not runs_kernel(k_cache.shape[-1], impl):
    return reference(parts, k_cache, v_cache, index, start)

  def kernel(parts, k_cache, v_cache, index, start):
    inv_freq = inverse_frequencies(k_cache.shape[-1], float(rope_base))
    return triton.decode_qkv(parts, k_cache, v_cache, index, start, inv_freq, jnp.dtype(dtype),
                             interpret=jax.default_backend() != "gpu")

  return with_reference_vjp(kernel, reference, parts, k_cache, v_cache, index, start)


def runs_product_kernel(rows: int, d: int, dh: int, impl: str = "auto") -> bool:
  """Whether decode_qkv_product runs its one kernel: where decode_qkv's runs (runs_kernel) and the product
  fits it (one row, d a power of two, COLUMNS dividing dh / 2: triton_product.fits)."""
  return runs_kernel(dh, impl) and triton_product.fits(rows, d, dh)


def decode_qkv_product(
    x: Float[Array, "rows d"],
    w: Num[Array, "d three_h_dh"],
    k_cache: Float[Array, "b s h dh"],
    v_cache: Float[Array, "b s h dh"],
    index: Int[Array, ""],
    start: Int[Array, "b"],
    *,
    norm: tuple[Float[Array, "d"], float] | None = None,
    rope_base: float,
    dtype,
    impl: str = "auto",
) -> tuple[Float[Array, "b h dh"], Float[Array, "b s h dh"], Float[Array, "b s h dh"]]:
  """decode_qkv of qkv = rms_norm(x, *norm) W (x W when norm is None): one kernel where runs_product_kernel
  holds, else the reference in XLA's kernels."""
  index = jnp.asarray(index)
  _checks.check_rank("x", x, 2, "[rows, d]")
  _checks.check_floating("x", x)
  _checks.check_rank("w", w, 2, "[d, 3 * heads * head_dim]")
  if x.shape[1] != w.shape[0]:
    raise ValueError(f"x [rows, {x.shape[1]}] and w [{w.shape[0]}, ...] must share d.")
  if norm is not None and tuple(jnp.shape(norm[0])) != (x.shape[1],):
    raise ValueError(f"norm's scale must be [{x.shape[1]}] (x's d); got {tuple(jnp.shape(norm[0]))}.")
  _check(jnp.zeros((1, x.shape[0], w.shape[1]), jnp.float32), k_cache, v_cache, index, start, impl)
  b, dh = k_cache.shape[0], k_cache.shape[-1]
  if x.shape[0] != b:
    raise ValueError(f"x must have one row per cache row ({b}); got {x.shape[0]}.")
  g, eps = (None, None) if norm is None else (norm[0], float(norm[1]))
  reference = lambda x, w, g, k, v, i, s: decode_qkv_product_reference(x, w, g, k, v, i, s, eps, rope_base, dtype)
  if not runs_product_kernel(x.shape[0], x.shape[1], dh, impl):
    return reference(x, w, g, k_cache, v_cache, index, start)

  def kernel(x, w, g, k_cache, v_cache, index, start):
    inv_freq = inverse_frequencies(dh, float(rope_base))
    operands = (x,) if g is None else (x, g)
    return triton_product.decode_qkv_product(operands, w, k_cache, v_cache, index, start, inv_freq, eps,
                                             jnp.dtype(dtype), interpret=jax.default_backend() != "gpu")

  return with_reference_vjp(kernel, reference, x, w, g, k_cache, v_cache, index, start)
