"""decode_qkv_attention: a decode step's query and cache slot from the qkv product's split-K parts, then its
attention over the cache, at one query a row.

  q, k_cache, v_cache = decode_qkv(parts, k_cache, v_cache, index, start)   (slot `index` written)
  o = decode_attention(q, k_cache, v_cache, start, index)                   (q's dtype)
Backends: "triton" (triton.py, one kernel for both; off the GPU in interpret mode) and "xla" (decode_qkv, then
decode_attention, each on its own "auto"); "auto" takes triton on a GPU where both kernels fit. Differentiable:
the cotangents are the reference's (decode_qkv's reference, then decode_attention's).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax.kernels._reference_vjp import with_reference_vjp
from sparsejax.kernels.decode_attention import decode_attention, decode_attention_reference
from sparsejax.kernels.decode_attention import op as attention_op
from sparsejax.kernels.decode_qkv import decode_qkv, decode_qkv_reference
from sparsejax.kernels.decode_qkv import op as qkv_op
from sparsejax.kernels.decode_qkv_attention import triton
from sparsejax.rope import inverse_frequencies

IMPLS = ("auto", "triton", "xla")


def kernel_fits(dh: int, slots: int) -> bool:
  """Both kernels' shapes: head_dim a power of two >= 16 (its halves then are too), >= MIN_SLOTS slots."""
  return qkv_op.kernel_fits(dh) and attention_op.kernel_fits(dh, slots)


def runs_kernel(dh: int, slots: int, impl: str = "auto") -> bool:
  """Whether the one kernel runs: impl "triton", or "auto" on a GPU where it fits."""
  return impl == "triton" or (impl == "auto" and jax.default_backend() == "gpu" and kernel_fits(dh, slots))


def decode_qkv_attention(
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
  """(o [b, h, dh] in dtype, k_cache, v_cache with slot `index` written): the module doc's math."""
  index = jnp.asarray(index)
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  sub = "xla" if impl == "xla" else "auto"
  # decode_qkv's checks cover parts, the caches, index and start (decode_attention's add nothing for these).
  qkv_op.check_inputs(parts, k_cache, v_cache, index, start, sub)
  b, slots, h, dh = k_cache.shape
  if impl == "triton" and not kernel_fits(dh, slots):
    raise ValueError(f"impl='triton' needs head_dim a power of two >= 16 and >= {attention_op.triton.MIN_SLOTS} "
                     f"cache slots; got head_dim {dh}, {slots} slots (use impl='auto').")
  if not runs_kernel(dh, slots, impl):
    q, k_cache, v_cache = decode_qkv(parts, k_cache, v_cache, index, start, rope_base=rope_base, dtype=dtype,
                                     impl=sub)
    return decode_attention(q, k_cache, v_cache, start, index, impl=sub), k_cache, v_cache

  def reference(parts, k_cache, v_cache, index, start):
    q, k_cache, v_cache = decode_qkv_reference(parts, k_cache, v_cache, index, start, rope_base, dtype)
    return decode_attention_reference(q, k_cache, v_cache, start, index), k_cache, v_cache

  def kernel(parts, k_cache, v_cache, index, start):
    inv_freq = inverse_frequencies(dh, float(rope_base))
    part, stats, k_cache, v_cache = triton.qkv_chunk_attention(parts, k_cache, v_cache, index, start, inv_freq,
                                                               jnp.dtype(dtype),
                                                               interpret=jax.default_backend() != "gpu")
    return attention_op.merge_chunks(part, stats, jnp.dtype(dtype)), k_cache, v_cache

  return with_reference_vjp(kernel, reference, parts, k_cache, v_cache, index, start)
