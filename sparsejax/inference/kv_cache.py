"""The KV cache's pure pieces: where new keys go, which slots a query sees, and RoPE positions.

Prompts of different lengths share one cache by LEFT-padding: row b's prompt fills slots
[start[b], P) of a cache of S slots, so every row writes its next token into the same slot
(`index`, one scalar for the batch, as in flax.nnx.MultiHeadAttention), one dynamic_update_slice
serves the whole batch, and the prompt's last token sits in slot P - 1 for every row. The price is
a per-row offset: the token in slot s of row b has RoPE position s - start[b] (what the model saw
in training), and slots before start[b] are masked out.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def write(cache: Float[Array, "b s h d"], new: Float[Array, "b t h d"],
          index: Int[Array, ""]) -> Float[Array, "b s h d"]:
  """cache[:, index : index + t] = new (one dynamic_update_slice for the whole batch)."""
  zero = jnp.zeros((), jnp.int32)
  return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (zero, index.astype(jnp.int32), zero, zero))


def positions(index: Int[Array, ""], start: Int[Array, "b"], t: int) -> Int[Array, "b t"]:
  """pos[b, i] = index + i - start[b]: the RoPE position of the i-th new token of row b."""
  return index + jnp.arange(t, dtype=jnp.int32)[None, :] - start[:, None]


def mask(index: Int[Array, ""], start: Int[Array, "b"], t: int, cache_len: int) -> Bool[Array, "b 1 t s"]:
  """Query i of row b (slot q = index + i) sees slot j iff start[b] <= j <= q, or j == q.

  j == q lets a padding query see itself: no row of the softmax is empty, so no NaN is born in
  padding rows (their outputs are never read, but a NaN could still leak through a 0 * NaN).
  """
  q = index + jnp.arange(t, dtype=jnp.int32)[:, None]  # [t, 1]
  j = jnp.arange(cache_len, dtype=jnp.int32)[None, :]  # [1, s]
  seen = ((j >= start[:, None, None]) & (j <= q[None])) | (j == q)[None]
  return seen[:, None]
