"""The plain-jnp residual_norm that every backend is tested against (and that XLA runs off the GPU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax.top_k import top_k_small


def pending_delta(
    parts: Float[Array, "slots splits rows d"],
    combine: Float[Array, "m slots"] | None,
    m: int,
    dtype,
) -> Float[Array, "m d"]:
  """delta = round(sum_s c[:, s] round(sum_p parts[s, p])) over the first m rows, in dtype: a layer's
  output from its products' split-K partials, rounded where the unfused layer rounds (each product's
  .astype(dtype), then the combine's). combine None: one slot of weight 1, rounded once."""
  y = jnp.sum(parts[:, :, :m], axis=1).astype(dtype)  # [slots, m, d]
  if combine is None:
    return y[0]
  return jnp.einsum("ms,smd->md", combine.astype(jnp.float32), y.astype(jnp.float32)).astype(dtype)


def rms_norm(h: Float[Array, "m d"], scale: Float[Array, "d"], eps: float) -> Float[Array, "m d"]:
  """h / sqrt(mean(h^2) + eps) * scale in float32, returned in h's dtype (models.transformer.RMSNorm)."""
  h32 = h.astype(jnp.float32)
  y = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(h.dtype)


def route_top_k(n: Float[Array, "m d"], w_router: Float[Array, "d experts"], k: int, renormalize: bool
                ) -> tuple[Float[Array, "m experts"], Int[Array, "m k"], Float[Array, "m k"]]:
  """(logits, ids, weights): logits = n W_r in float32, p = softmax(logits), ids its k largest (lower
  index first among ties), weights p[ids] (/ their sum if renormalize): routing.top_k_routing's."""
  logits = jnp.dot(n.astype(jnp.float32), w_router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  probs = jax.nn.softmax(logits, axis=-1)
  ids = top_k_small(probs, k)[1].astype(jnp.int32)
  weights = jnp.take_along_axis(probs, ids, axis=-1)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return logits, ids, weights


def residual_norm_reference(
    x: Float[Array, "m d"],
    parts: Float[Array, "slots splits rows d"] | None,
    combine: Float[Array, "m slots"] | None,
    scale: Float[Array, "d"],
    *,
    eps: float,
    w_router: Float[Array, "d experts"] | None = None,
    k: int = 1,
    renormalize: bool = False,
) -> tuple:
  """(h, n) or (h, n, logits, ids, weights): h = round(x + pending_delta), n = rms_norm(h), and with
  w_router the top-k routing of n (route_top_k)."""
  h = x if parts is None else (x.astype(jnp.float32)
                               + pending_delta(parts, combine, x.shape[0], x.dtype).astype(jnp.float32)).astype(x.dtype)
  n = rms_norm(h, scale, eps)
  if w_router is None:
    return h, n
  return (h, n) + route_top_k(n, w_router, k, renormalize)
