"""Router auxiliary losses (returned, never stashed in module state)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax import _checks


@jax.named_scope("aux_losses")
def load_balancing_loss(
    router_probs: Float[Array, "tokens experts"],
    expert_ids: Int[Array, "tokens k"],
) -> Float[Array, ""]:
  """Switch Transformer's loss: E * sum_i f_i * P_i.

  f_i = fraction of the (token, slot) assignments sent to expert i (ids outside [0, E) are not
  assignments), P_i = mean over tokens of router_probs[:, i]. Equals 1 under uniform routing;
  its gradient flows through P only (f is a count).
  """
  _checks.check_rank("router_probs", router_probs, 2, "[tokens, experts]")
  _checks.check_tokens("router_probs", router_probs)
  if jnp.ndim(expert_ids) == 1:
    expert_ids = expert_ids[:, None]
  _checks.check_rank("expert_ids", expert_ids, 2, "[tokens, k]")
  _checks.check_integer("expert_ids", expert_ids)
  if expert_ids.shape[0] != router_probs.shape[0]:
    raise ValueError(
        f"expert_ids has {expert_ids.shape[0]} tokens but router_probs has {router_probs.shape[0]}.")
  num_experts = router_probs.shape[1]
  one_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32)  # out-of-range ids -> zeros
  counts = jnp.sum(one_hot, axis=(0, 1))
  f = counts / jnp.maximum(jnp.sum(counts), 1.0)
  p = jnp.mean(router_probs.astype(jnp.float32), axis=0)
  return num_experts * jnp.sum(jax.lax.stop_gradient(f) * p)


@jax.named_scope("aux_losses")
def router_z_loss(logits: Float[Array, "tokens experts"]) -> Float[Array, ""]:
  """ST-MoE's z-loss: mean over tokens of logsumexp(logits)^2, computed in float32."""
  _checks.check_rank("logits", logits, 2, "[tokens, experts]")
  _checks.check_tokens("logits", logits)
  _checks.check_floating("logits", logits)
  z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return jnp.mean(z * z)
