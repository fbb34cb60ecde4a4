"""RMSNorm as a pure function, shared by the model's module and the kernels that fold it into a product."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


@jax.named_scope("rms_norm")
def rms_norm(x: Float[Array, "... d"], scale: Float[Array, "d"], eps: float) -> Float[Array, "... d"]:
  """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32 and returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)
