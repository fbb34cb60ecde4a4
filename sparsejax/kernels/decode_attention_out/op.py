"""decode_attention_out: a decode step's attention and its output projection at one row.

  o[b, h] = decode_attention(q, k_cache, v_cache, start, index)[b, h]       (q's dtype)
  y[b]    = concat_h o[b, h] @ w_o                                        (float32; w_o [h dh, d])
The counter [2] int32 is state the caller carries from call to call (zeros to start: Attention.init_cache
keeps it beside the KV cache); the kernel uses it to hand the attention to the projection inside one grid
and leaves it zero. Backends: "triton" (triton.py; off the GPU in interpret mode) for one row, and "xla"
(decode_attention, then skinny_matmul, each on its own "auto"); "auto" takes triton on a GPU where it fits
(runs_kernel), else what "xla" runs. Differentiable in q, the caches and w_o: the cotangents are the
reference's. Reference: decode_attention_reference, then the product in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Num

from sparsejax import _checks
from sparsejax._precision import dot_precision
from sparsejax.kernels._reference_vjp import with_reference_vjp
from sparsejax.kernels.decode_attention import decode_attention, decode_attention_reference
from sparsejax.kernels.decode_attention import triton as attention
from sparsejax.kernels.decode_attention_out import triton
from sparsejax.kernels.skinny_matmul import skinny_matmul

IMPLS = ("auto", "triton", "xla")


def kernel_fits(b: int, h: int, dh: int, slots: int, d: int) -> bool:
  """One row, decode_attention's kernel shapes (dh a power of two >= 16, >= MIN_SLOTS slots) and W_o tiles."""
  return (b == 1 and dh >= 16 and dh & (dh - 1) == 0 and slots >= attention.MIN_SLOTS
          and triton.tiles(h, dh, d) is not None)


def runs_kernel(b: int, h: int, dh: int, slots: int, d: int, impl: str = "auto") -> bool:
  """Whether the one-grid kernel runs: impl "triton", or "auto" on a GPU where it fits."""
  return impl == "triton" or (impl == "auto" and jax.default_backend() == "gpu" and kernel_fits(b, h, dh, slots, d))


def _check(q, k_cache, w_o, counter, impl):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  _checks.check_rank("q", q, 3, "[batch, heads, head_dim]")
  _checks.check_rank("w_o", w_o, 2, "[heads * head_dim, d_model]")
  _checks.check_floating("w_o", w_o)
  b, h, dh = q.shape
  if w_o.shape[0] != h * dh:
    raise ValueError(f"w_o must be [heads * head_dim = {h * dh}, d_model]; got {w_o.shape}.")
  _checks.check_rank("counter", counter, 1, "[2]")
  _checks.check_integer("counter", counter)
  if counter.shape != (2,):
    raise ValueError(f"counter must have shape (2,) (zeros to start, then what the last call returned); "
                     f"got {counter.shape}.")
  if impl == "triton" and not kernel_fits(b, h, dh, k_cache.shape[1], w_o.shape[1]):
    raise ValueError(f"impl='triton' takes one row, head_dim a power of two >= 16, >= {attention.MIN_SLOTS} cache "
                     f"slots and d_model a multiple of 16; got q {q.shape}, {k_cache.shape[1]} slots, w_o {w_o.shape} "
                     f"(use impl='auto').")


def _reference(q, k_cache, v_cache, start, index, w_o, counter):
  o = decode_attention_reference(q, k_cache, v_cache, start, index).reshape(q.shape[0], -1)
  y = jnp.dot(o, w_o.astype(o.dtype), precision=dot_precision(o.dtype), preferred_element_type=jnp.float32)
  return y, counter


def decode_attention_out(
    q: Float[Array, "b h dh"],
    k_cache: Float[Array, "b s h dh"],
    v_cache: Float[Array, "b s h dh"],
    start: Int[Array, "b"],
    index: Int[Array, ""],
    w_o: Num[Array, "hdh d"],
    counter: Int[Array, "2"],
    *,
    impl: str = "auto",
) -> tuple[Float[Array, "b d"], Int[Array, "2"]]:
  """(y, counter): the module doc's y (float32) and the counter to pass to the next call."""
  index = jnp.asarray(index)
  _check(q, k_cache, w_o, counter, impl)
  b, h, dh = q.shape
  if not runs_kernel(b, h, dh, k_cache.shape[1], w_o.shape[1], impl):
    sub = "xla" if impl == "xla" else "auto"
    o = decode_attention(q, k_cache, v_cache, start, index, impl=sub)
    return skinny_matmul(o.reshape(b, h * dh), w_o, impl=sub), counter
  rk, bn = triton.tiles(h, dh, w_o.shape[1])

  def kernel(q, k_cache, v_cache, start, index, w_o, counter):
    parts, counter = triton.attention_out_parts(q, k_cache, v_cache, start, index, w_o.reshape(h, dh, -1), counter,
                                                rk, bn, interpret=jax.default_backend() != "gpu")
    return parts.sum(axis=0, keepdims=True), counter

  return with_reference_vjp(kernel, _reference, q, k_cache, v_cache, start, index, w_o, counter)
