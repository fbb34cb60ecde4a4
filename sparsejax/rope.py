"""Rotary position embeddings as pure functions, shared by the model and the decode kernels."""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def inverse_frequencies(head_dim: int, base: float) -> Float[Array, "half"]:
  """base^(-2i / head_dim) for i < head_dim / 2, float32: pair i turns by p * inv[i] at position p."""
  return base ** (-jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)


def rotary(x: Float[Array, "b t h d"], base: float,
           positions: Int[Array, "b t"] | None = None) -> Float[Array, "b t h d"]:
  """RoPE (Su et al.): rotate pairs (x_i, x_{i+d/2}) by angle p * base^(-2i/d), in float32.

  p is the token's position: positions[b, t] when given (cached decoding), else t.
  """
  t, d = x.shape[1], x.shape[-1]
  inv_freq = inverse_frequencies(d, base)
  pos = jnp.arange(t, dtype=jnp.float32)[None, :] if positions is None else positions.astype(jnp.float32)
  angles = pos[:, :, None] * inv_freq  # [b or 1, t, d/2]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
