"""The plain-jnp skinny_matmul that every backend is tested against (and that XLA runs off the GPU)."""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Num

from sparsejax._precision import dot_precision

def skinny_matmul_reference(
    x: Float[Array, "slots m k"],
    w: Num[Array, "experts k n"],
    experts: Int[Array, "slots"],
    scale: Float[Array, "experts n"] | None = None,
) -> Float[Array, "slots m n"]:
  """y[s] = x[s] @ (w[e_s] * scale[e_s]) in float32 (int8 w enters as x's dtype), and y[s] = 0 where e_s is
  outside [0, E): a slot with no expert."""
  ws = jnp.take(w, experts, axis=0, mode="clip").astype(x.dtype)
  y = jnp.einsum("smk,skn->smn", x, ws, precision=dot_precision(x.dtype), preferred_element_type=jnp.float32)
  if scale is not None:
    y = y * jnp.take(scale, experts, axis=0, mode="clip").astype(jnp.float32)[:, None, :]
  present = (experts >= 0) & (experts < w.shape[0])
  return jnp.where(present[:, None, None], y, 0.0)
