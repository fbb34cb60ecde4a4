"""The plain-jnp decode attention that the kernels are tested against (and that XLA runs off the GPU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax.inference import kv_cache
from sparsejax.rope import rotary


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


def decode_attention_step_reference(
    qkv_parts: Float[Array, "splits b 3 h dh"],
    k_cache: Float[Array, "b s h dh"],
    v_cache: Float[Array, "b s h dh"],
    start: Int[Array, "b"],
    index: Int[Array, ""],
    *,
    rope_base: float,
    dtype,
) -> tuple[Float[Array, "b h dh"], Float[Array, "b s h dh"], Float[Array, "b s h dh"]]:
  """A decode step's attention from its projection's split-K parts, as the Transformer wrote it out:
  qkv = sum_p parts[p] in dtype; q, k rotated (RoPE at position index - start[b]); k and v written
  into slot `index` of the caches; (decode_attention of q over them, the new caches)."""
  qkv = jnp.sum(qkv_parts, axis=0).astype(dtype)[:, None]  # [b, 1, 3, h, dh]
  pos = kv_cache.positions(index, start, 1)
  q, k = rotary(qkv[:, :, 0], rope_base, pos), rotary(qkv[:, :, 1], rope_base, pos)
  k_cache, v_cache = kv_cache.write(k_cache, k, index), kv_cache.write(v_cache, qkv[:, :, 2], index)
  return decode_attention_reference(q[:, 0], k_cache, v_cache, start, index), k_cache, v_cache
