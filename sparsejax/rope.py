"""Rotary position embedding (RoPE, Su et al.): the Transformer's attention and the decode step's
fused attention kernel (kernels/decode_attention) both rotate queries and keys with these numbers."""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def inv_freq(head_dim: int, base: float) -> Float[Array, "half"]:
  """base^(-2i/d) for i < d/2: the angle per position of the pair (x_i, x_{i+d/2})."""
  return base ** (-jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)


def rotary(x: Float[Array, "b t h d"], base: float,
           positions: Int[Array, "b t"] | None = None) -> Float[Array, "b t h d"]:
  """RoPE: rotate pairs (x_i, x_{i+d/2}) by angle p * base^(-2i/d), in float32.

  p is the token's position: positions[b, t] when given (cached decoding), else t.
  """
  t, d = x.shape[1], x.shape[-1]
  pos = jnp.arange(t, dtype=jnp.float32)[None, :] if positions is None else positions.astype(jnp.float32)
  angles = pos[:, :, None] * inv_freq(d, base)  # [b or 1, t, d/2]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
