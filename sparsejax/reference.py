"""Slow, obviously-right references the fast paths are tested against (float32, dense masked)."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

HI = jax.lax.Precision.HIGHEST  # float32 on every backend (XLA on GPU would use TF32)


def capacity_keep_mask_reference(
    expert_ids: Int[Array, "tokens k"], num_experts: int, capacity: int
) -> Array:
  """keep[t, j] iff fewer than C earlier assignments (token-major order) went to expert_ids[t, j]."""
  one_hot = jax.nn.one_hot(expert_ids.reshape(-1), num_experts, dtype=jnp.int32)
  position = jnp.cumsum(one_hot, axis=0) - one_hot  # assignments to the same expert before this one
  pos = jnp.sum(position * one_hot, axis=-1).reshape(expert_ids.shape)
  valid = (expert_ids >= 0) & (expert_ids < num_experts)
  return valid & (pos < capacity)


def moe_mlp_reference(
    x: Float[Array, "tokens d_model"],
    expert_ids: Int[Array, "tokens k"],
    combine_weights: Float[Array, "tokens k"],
    w_in: Float[Array, "experts d_model d_ff"],
    w_out: Float[Array, "experts d_ff d_model"],
    *,
    w_gate=None,
    activation: Callable = jax.nn.gelu,
    capacity: int | None = None,
) -> Float[Array, "tokens d_model"]:
  """Every expert on every token in float32, then y[t] = sum_e W[t, e] FFN_e(x[t]) with W the
  (kept) combine weights scattered to a dense [T, E] matrix."""
  f32 = lambda a: None if a is None else a.astype(jnp.float32)
  x, w_in, w_out, w_gate = f32(x), f32(w_in), f32(w_out), f32(w_gate)
  num_experts = w_in.shape[0]
  h = jnp.einsum("td,edf->tef", x, w_in, precision=HI)
  if w_gate is not None:
    h = activation(jnp.einsum("td,edf->tef", x, w_gate, precision=HI)) * h
  else:
    h = activation(h)
  out = jnp.einsum("tef,efd->ted", h, w_out, precision=HI)
  keep = (expert_ids >= 0) & (expert_ids < num_experts)
  if capacity is not None:
    keep = capacity_keep_mask_reference(expert_ids, num_experts, capacity)
  w = jnp.where(keep, combine_weights.astype(jnp.float32), 0.0)
  dense_w = jnp.sum(jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32) * w[..., None], axis=1)
  return jnp.einsum("te,ted->td", dense_w, out, precision=HI)
