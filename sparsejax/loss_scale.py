"""Dynamic loss scaling, for training with float16 compute (Micikevicius et al., 2018, "Mixed precision training").

float16's smallest normal number is 6.1e-5 (subnormals reach 6e-8), and a language model's activation gradients,
each a token's share of a mean over the batch, fall below that and round to zero. The train step multiplies the
loss by S before differentiating and divides the gradients by S after, so the float16 backward carries them S times
larger. S is a power of two, which float32 multiplies exactly: wherever nothing under- or overflows, the update is
that of the unscaled loss, bit for bit.

S adapts (as in PyTorch's GradScaler and Flax's DynamicScale): a step whose gradients are not finite (the scaled
backward overflowed) is skipped, the optimizer state kept, and S halved; after `growth_interval` finite steps in a
row S doubles. S and its count live in the optimizer state, so a checkpoint resumes them.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int


class LossScaleState(NamedTuple):
  scale: Float[Array, ""]          # S, float32
  finite_steps: Int[Array, ""]     # finite steps since S last changed
  inner: optax.OptState


def all_finite(tree) -> jax.Array:
  """Whether every element of every leaf is finite (a scalar bool)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def dynamic_loss_scale(inner: optax.GradientTransformation, *, init_scale: float = 2.0 ** 15,
                       growth_interval: int = 2000, factor: float = 2.0) -> optax.GradientTransformation:
  """inner, skipped where its (already unscaled) gradients are not finite, with S kept beside its state.

  A non-finite step: zero updates, inner's state unchanged, S <- max(S / factor, 1). A finite one: inner's update,
  and S <- S * factor once growth_interval finite steps have run since S last changed. The step reads S with
  loss_scale(opt_state).
  """
  if not (init_scale >= 1 and math.log2(init_scale).is_integer()):
    raise ValueError(f"init_scale must be a power of two >= 1 (exact in float32); got {init_scale}.")
  if not (factor > 1 and math.log2(factor).is_integer()):
    raise ValueError(f"factor must be a power of two > 1; got {factor}.")
  if not (isinstance(growth_interval, int) and growth_interval >= 1):
    raise ValueError(f"growth_interval must be an integer >= 1; got {growth_interval!r}.")

  def init(params):
    return LossScaleState(jnp.float32(init_scale), jnp.int32(0), inner.init(params))

  def update(grads, state, params=None):
    finite = all_finite(grads)
    updates, new_inner = inner.update(grads, state.inner, params)
    updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
    new_inner = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_inner, state.inner)
    grow = state.finite_steps + 1 >= growth_interval
    scale = jnp.where(finite, jnp.where(grow, state.scale * factor, state.scale),
                      jnp.maximum(state.scale / factor, 1.0))
    finite_steps = jnp.where(finite & ~grow, state.finite_steps + 1, 0)
    return updates, LossScaleState(scale, finite_steps.astype(jnp.int32), new_inner)

  return optax.GradientTransformation(init, update)


def loss_scale(opt_state) -> Float[Array, ""] | None:
  """S of a dynamic_loss_scale optimizer's state; None for any other optimizer (the step then scales nothing)."""
  return opt_state.scale if isinstance(opt_state, LossScaleState) else None
