"""decode_router's reference: the library's own router, softmax and top-k (what the model runs elsewhere)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax import routing


def decode_router_reference(
    x: Float[Array, "tokens d_model"],
    w_router: Float[Array, "d_model experts"],
    k: int,
    renormalize: bool | None = None,
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
  """(expert ids, combine weights) of top_k_routing(router_logits(x, w_router), k, renormalize)."""
  r = routing.top_k_routing(routing.router_logits(x, w_router), k, renormalize=renormalize)
  return r.expert_ids, r.combine_weights


def logit_parts_reference(
    x: Float[Array, "tokens d_model"],
    w_router: Float[Array, "d_model experts"],
    splits: int,
) -> Float[Array, "tokens splits experts"]:
  """parts[t, s] = float32(x[t, R_s]) W_r[R_s, :] over the s-th of `splits` equal row ranges R_s, float32."""
  t, d = x.shape
  xs = x.astype(jnp.float32).reshape(t, splits, d // splits)
  ws = w_router.astype(jnp.float32).reshape(splits, d // splits, -1)
  return jnp.einsum("tsr,sre->tse", xs, ws, precision=jax.lax.Precision.HIGHEST)


def select_from_parts(
    parts: Float[Array, "tokens splits experts"],
    k: int,
    renormalize: bool,
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
  """logits = the parts summed in split order; ids = its k largest, the lower expert first among equal ones
  (lax.top_k's order); weights = softmax(logits)[ids], divided by their sum when renormalize."""
  logits = parts[:, 0]
  for s in range(1, parts.shape[1]):
    logits = logits + parts[:, s]
  _, ids = jax.lax.top_k(logits, k)
  wts = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), ids, axis=-1)
  if renormalize:
    wts = wts / jnp.sum(wts, axis=-1, keepdims=True)
  return ids.astype(jnp.int32), wts
