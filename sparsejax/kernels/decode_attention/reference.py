"""The plain-jnp decode attention that the kernel is tested against (and that XLA runs off the GPU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax.inference import kv_cache


def decode_attention_reference(
    q: Float[Array, "b h dh"],
    k_cache: Float[Array, "b s h dh"],
    v_cache: Float[Array, "b s h dh"],
    start: Int[Array, "b"],
    index: Int[Array, ""],
) -> Float[Array, "b h dh"]:
  """o[b, h] = softmax_j(q[b, h] . k[b, j, h] / sqrt(dh), over visible j) @ v[b, :, h]; float32 math."""
  scale = q.shape[-1] ** -0.5
  s = jnp.einsum("bhd,bshd->bhs", q.astype(jnp.float32), k_cache.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST) * scale
  # The query sits in slot `index`: kv_cache.mask's rule for one new token, [b, 1, 1, s] -> [b, 1, s].
  s = jnp.where(kv_cache.mask(index, start, 1, k_cache.shape[1])[:, :, 0], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bhs,bshd->bhd", p, v_cache.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return o.astype(q.dtype)
