"""decode_qkv: a decode step's qkv projection, given as split-K parts, into its query and cache slot.

  qkv[b] = sum_p parts[p, b] (rounded to dtype) as [3, h, dh];  pos_b = index - start[b]
  q[b] = RoPE(qkv[b, 0], pos_b);  k_cache[b, i] = RoPE(qkv[b, 1], pos_b);  v_cache[b, i] = qkv[b, 2]
with i = min(index, slots - 1): RoPE as sparsejax.rope.rotary, the write as inference.kv_cache.write (one
new token a row; its dynamic_update_slice clamps a write past the end onto the last slot). Backends:
"triton" (triton.py; off the GPU in interpret mode) and "xla" (reference.py); "auto" takes triton on a
GPU when dh / 2 is a power of two, where this jax has Pallas' Triton backend. Differentiable: the
cotangents are the reference's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax import _checks
from sparsejax.kernels import auto_takes_triton, require_triton
from sparsejax.kernels._reference_vjp import with_reference_vjp
from sparsejax.kernels.decode_qkv import triton
from sparsejax.kernels.decode_qkv.reference import decode_qkv_reference
from sparsejax.rope import inverse_frequencies

IMPLS = ("auto", "triton", "xla")


def _kernel_fits(dh: int) -> bool:
  half = dh // 2
  return dh % 2 == 0 and half & (half - 1) == 0


def runs_kernel(dh: int, impl: str = "auto") -> bool:
  """Whether decode_qkv runs the Pallas kernel (else XLA's kernels): impl "triton", or "auto" on a GPU
  for a head_dim whose halves are powers of two (Triton's vectors), where this jax has Pallas' Triton backend."""
  return impl == "triton" or (impl == "auto" and jax.default_backend() == "gpu" and _kernel_fits(dh)
                              and auto_takes_triton())


def _check(parts, k_cache, v_cache, index, start, impl):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  if impl == "triton":
    require_triton("decode_qkv(impl='triton')")
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
