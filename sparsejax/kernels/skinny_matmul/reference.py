"""The plain-jnp skinny_matmul that every backend is tested against (and that XLA runs off the GPU)."""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Num

from sparsejax._precision import dot_precision


def k_major(dtype) -> bool:
  """Whether a weight of this dtype is stored k-major, [.., n, k], each output column's K values contiguous: int8
  (inference.quantize_weight's layout). Read n-major ([k, n]), Triton gathers an int8 dot's operand from shared
  memory a byte at a time; k-major, the same product took 20-25% less time on an H200
  (experiments/probe_int8_weight_layout.py). Float weights stay [.., k, n]. Every backend and the reference
  follow it."""
  return jnp.dtype(dtype) == jnp.int8


def kn(w) -> tuple[int, int]:
  """(k, n) of a weight as the product reads it, whichever way it is stored (k_major)."""
  return (w.shape[-1], w.shape[-2]) if k_major(w.dtype) else (w.shape[-2], w.shape[-1])


def skinny_matmul_reference(
    x: Float[Array, "slots m k"],
    w: Num[Array, "experts k n"],
    experts: Int[Array, "slots"],
    scale: Float[Array, "experts n"] | None = None,
) -> Float[Array, "slots m n"]:
  """y[s] = x[s] @ (W[e_s] * scale[e_s]) in float32, and y[s] = 0 where e_s is outside [0, E): a slot with no
  expert. W = w [E, k, n]; int8 w is stored k-major, W = w^T (k_major), and enters as x's dtype."""
  ws = jnp.take(w, experts, axis=0, mode="clip").astype(x.dtype)
  if k_major(w.dtype):
    ws = jnp.swapaxes(ws, -1, -2)
  y = jnp.einsum("smk,skn->smn", x, ws, precision=dot_precision(x.dtype), preferred_element_type=jnp.float32)
  if scale is not None:
    y = y * jnp.take(scale, experts, axis=0, mode="clip").astype(jnp.float32)[:, None, :]
  present = (experts >= 0) & (experts < w.shape[0])
  return jnp.where(present[:, None, None], y, 0.0)
