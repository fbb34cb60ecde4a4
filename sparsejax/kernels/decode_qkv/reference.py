"""The plain-jnp decode_qkv that the kernel is tested against (and that XLA runs off the GPU)."""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax.inference import kv_cache
from sparsejax.rope import rotary


def decode_qkv_reference(
    parts: Float[Array, "splits rows three_h_dh"],
    k_cache: Float[Array, "b s h dh"],
    v_cache: Float[Array, "b s h dh"],
    index: Int[Array, ""],
    start: Int[Array, "b"],
    rope_base: float,
    dtype,
) -> tuple[Float[Array, "b h dh"], Float[Array, "b s h dh"], Float[Array, "b s h dh"]]:
  """qkv[b] = sum_p parts[p, b] in dtype, as [3, h, dh]; q = RoPE(qkv[0]), k = RoPE(qkv[1]), v = qkv[2] at
  position index - start[b]; returns q and the caches with slot `index` of every row set to k and v."""
  b, _, h, dh = k_cache.shape
  qkv = jnp.sum(parts, axis=0)[:b].astype(dtype).reshape(b, 1, 3, h, dh)
  pos = kv_cache.positions(index, start, 1)
  q, k = rotary(qkv[:, :, 0], rope_base, pos), rotary(qkv[:, :, 1], rope_base, pos)
  return (q[:, 0], kv_cache.write(k_cache, k, index), kv_cache.write(v_cache, qkv[:, :, 2], index))
