"""The plain-jnp decode attention that the kernel is tested against (and that XLA runs off the GPU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def visible(index: Int[Array, ""], start: Int[Array, "b"], slots: int) -> jax.Array:
  """[b, slots]: the query in slot `index` of row b sees slot j iff start[b] <= j <= index, or j == index
  (so a padding row's query, index < start[b], still sees itself: no empty softmax; see inference.kv_cache)."""
  j = jnp.arange(slots, dtype=jnp.int32)[None, :]
  return ((j >= start[:, None]) & (j <= index)) | (j == index)


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
  s = jnp.where(visible(index, start, k_cache.shape[1])[:, None, :], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bhs,bshd->bhd", p, v_cache.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return o.astype(q.dtype)
