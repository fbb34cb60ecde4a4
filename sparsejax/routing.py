"""Routers as pure functions of router logits.

Every router computes in float32 whatever the model dtype (ST-MoE's selective precision): the
softmax over experts is where bf16 rounding changes which expert wins.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

from sparsejax import _checks, _precision
from sparsejax.top_k import top_k_small

# An expert id of -1 marks a (token, slot) pair that goes to no expert. Token-choice routers
# never emit it; the dense-to-sparse gate does, for experts under its threshold.
NO_EXPERT = -1


@flax.struct.dataclass
class TokenChoiceRouting:
  """Each token picks up to k experts.

  expert_ids: [T, k] int32, distinct per token (or NO_EXPERT).
  combine_weights: [T, k] float32, the weight of each pick in the output sum.
  router_probs: [T, E] float32 softmax of the logits (what the load-balancing loss uses).
  router_logits: [T, E] float32 logits (what the z-loss uses).
  """
  expert_ids: Int[Array, "tokens k"]
  combine_weights: Float[Array, "tokens k"]
  router_probs: Float[Array, "tokens experts"]
  router_logits: Float[Array, "tokens experts"]


@flax.struct.dataclass
class ExpertChoiceRouting:
  """Each expert picks exactly C tokens (Zhou et al. 2022).

  token_ids: [E, C] int32, the tokens expert e processes.
  combine_weights: [E, C] float32, router_probs[token_ids[e, c], e].
  router_probs: [T, E] float32 softmax over experts.
  router_logits: [T, E] float32.
  """
  token_ids: Int[Array, "experts capacity"]
  combine_weights: Float[Array, "experts capacity"]
  router_probs: Float[Array, "tokens experts"]
  router_logits: Float[Array, "tokens experts"]


def _as_f32_logits(logits) -> Float[Array, "tokens experts"]:
  _checks.check_rank("logits", logits, 2, "[tokens, experts]")
  _checks.check_floating("logits", logits)
  return jnp.asarray(logits).astype(jnp.float32)


@jax.named_scope("router")
def router_logits(
    x: Float[Array, "tokens d_model"],
    w_router: Float[Array, "d_model experts"],
    *,
    jitter_eps: float = 0.0,
    rng: jax.Array | None = None,
) -> Float[Array, "tokens experts"]:
  """logits = (x * u) @ W in float32, u ~ U[1 - eps, 1 + eps] (Switch's multiplicative jitter).

  Pass rng only while training: without it no noise is applied.
  """
  _checks.check_router(x, w_router)
  if jitter_eps < 0:
    raise ValueError(f"jitter_eps must be >= 0; got {jitter_eps}.")
  xin = x
  if rng is not None and jitter_eps > 0:
    xin = x.astype(jnp.float32) * jax.random.uniform(rng, x.shape, jnp.float32, 1.0 - jitter_eps, 1.0 + jitter_eps)
  # x's gradient is rounded to x's dtype: for bf16 x the backend's default (TF32 on a GPU, 2e-4
  # relative) is already far below bf16's rounding, so only a float32 x pays for full accuracy.
  half = jnp.finfo(x.dtype).bits < 32
  return _float32_product(xin, w_router.astype(jnp.float32), None if half else _precision.float32_by_bf16_passes())


def _matmul(a: Float[Array, "m k"], b: Float[Array, "k n"], precision) -> Float[Array, "m n"]:
  """a @ b at precision, with any dimension of size 1 zero-padded to 2 (and the result cut back).

  XLA:GPU turns a dot with one row (or column, or a contraction of one) into an elementwise multiply
  and a reduce, and that rewrite computed BF16_BF16_F32_X6 at bf16 accuracy on an H100 (jax 0.11.2:
  3e-3 relative for one token's logits, against 1e-7 at two tokens). Zeros add nothing to the product.
  """
  (m, k), n = a.shape, b.shape[1]
  a = jnp.pad(a, ((0, int(m == 1)), (0, int(k == 1))))
  b = jnp.pad(b, ((0, int(k == 1)), (0, int(n == 1))))
  return jnp.matmul(a, b, precision=precision)[:m, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _float32_product(
    x: Float[Array, "tokens d_model"], w: Float[Array, "d_model experts"], dx_precision
) -> Float[Array, "tokens experts"]:
  """float32(x) @ w to float32 accuracy; the gradients dW = x^T g likewise, dx = g W^T at dx_precision.

  Not the default precision: a GPU reads a float32 dot's operands as TF32 (10-bit mantissas), which
  moved routing weights by 2e-4 relative on an H100; a float32 router is the point here. Six bf16
  passes are as accurate as a float32 dot and cheaper than HIGHEST (_precision.py). x is kept in
  its own dtype for the backward, not as a float32 copy.
  """
  return _matmul(x.astype(jnp.float32), w, _precision.float32_by_bf16_passes())


def _float32_product_fwd(x, w, dx_precision):
  return _float32_product(x, w, dx_precision), (x, w)


def _float32_product_bwd(dx_precision, res, g):
  x, w = res
  dx = _matmul(g, w.T, dx_precision).astype(x.dtype)
  dw = _matmul(x.astype(jnp.float32).T, g, _precision.float32_by_bf16_passes())
  return dx, dw


_float32_product.defvjp(_float32_product_fwd, _float32_product_bwd)


@jax.named_scope("router")
def top_k_routing(
    logits: Float[Array, "tokens experts"],
    k: int,
    *,
    renormalize: bool | None = None,
) -> TokenChoiceRouting:
  """p = softmax(logits); each token takes its k largest p_e; weights p_e (/ sum of the k if renormalize).

  k=1 is Switch (weight p_e, so the router still gets a gradient); k=2 GShard/Mixtral, whose
  weights are renormalized. renormalize=None means "k > 1".
  """
  logits = _as_f32_logits(logits)
  _checks.check_top_k(k, logits.shape[1])
  if renormalize is None:
    renormalize = k > 1
  probs = jax.nn.softmax(logits, axis=-1)
  ids = top_k_small(jax.lax.stop_gradient(probs), k)[1]  # lax.top_k's ids, without its GPU sort
  # The picked probabilities read through a one-hot mask rather than top_k's values: the same
  # numbers (one nonzero term a sum), but the backward is an elementwise fusion instead of
  # top_k's transpose, a scatter into a zeroed [T, E] buffer.
  weights = jnp.sum(probs[:, None, :] * jax.nn.one_hot(ids, probs.shape[1], dtype=probs.dtype), axis=-1)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return TokenChoiceRouting(ids.astype(jnp.int32), weights, probs, logits)


def expert_choice_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
  """C = ceil(capacity_factor * T / E), at most T: tokens per expert under expert choice."""
  _checks.check_positive("capacity_factor", capacity_factor)
  return int(min(num_tokens, max(1, math.ceil(capacity_factor * num_tokens / num_experts))))


@jax.named_scope("router")
def expert_choice_routing(
    logits: Float[Array, "tokens experts"], capacity_factor: float
) -> ExpertChoiceRouting:
  """p = softmax(logits) over experts; expert e takes the C tokens with the largest p[:, e].

  C = ceil(capacity_factor * T / E): on average each token is processed capacity_factor times.
  """
  logits = _as_f32_logits(logits)
  num_tokens, num_experts = logits.shape
  capacity = expert_choice_capacity(num_tokens, num_experts, capacity_factor)
  probs = jax.nn.softmax(logits, axis=-1)
  weights, token_ids = jax.lax.top_k(probs.T, capacity)
  return ExpertChoiceRouting(token_ids.astype(jnp.int32), weights, probs, logits)


@jax.named_scope("router")
def dense_to_sparse_routing(
    logits: Float[Array, "tokens experts"],
    temperature: float | jax.Array,
    threshold: float,
    *,
    max_k: int | None = None,
    rng: jax.Array | None = None,
) -> TokenChoiceRouting:
  """DTS-Gate (Nie et al. 2021): g = softmax((logits + Gumbel noise) / tau); keep experts with g > threshold.

  A high temperature makes g nearly uniform, so every expert passes the threshold (dense); as tau
  is annealed (`dts_temperature_schedule`) the gate sharpens and fewer experts pass (sparse). The
  kept weights are g itself (not renormalized). At most max_k (default E) experts are kept per
  token, the largest first; the slots of experts not kept hold NO_EXPERT with weight 0. The
  Gumbel noise is drawn only when rng is given (training).
  """
  logits = _as_f32_logits(logits)
  num_experts = logits.shape[1]
  max_k = num_experts if max_k is None else max_k
  _checks.check_top_k(max_k, num_experts)
  if not 0.0 <= threshold < 1.0:
    raise ValueError(f"threshold must lie in [0, 1); got {threshold}.")
  if isinstance(temperature, (int, float)):
    _checks.check_positive("temperature", temperature)
  noisy = logits
  if rng is not None:
    noisy = logits + jax.random.gumbel(rng, logits.shape, jnp.float32)
  gate = jax.nn.softmax(noisy / temperature, axis=-1)
  weights, ids = top_k_small(gate, max_k)
  keep = weights > threshold
  ids = jnp.where(keep, ids, NO_EXPERT).astype(jnp.int32)
  weights = jnp.where(keep, weights, 0.0)
  probs = jax.nn.softmax(logits, axis=-1)
  return TokenChoiceRouting(ids, weights, probs, logits)


def dts_temperature_schedule(
    init_temperature: float = 2.0,
    final_temperature: float = 0.03,
    transition_steps: int = 10_000,
) -> Callable[[int | jax.Array], jax.Array]:
  """tau(step) = init * (final / init) ** min(step / transition_steps, 1): geometric dense-to-sparse anneal."""
  _checks.check_positive("init_temperature", init_temperature)
  _checks.check_positive("final_temperature", final_temperature)
  _checks.check_positive("transition_steps", transition_steps)
  return optax.exponential_decay(
      init_value=init_temperature,
      transition_steps=transition_steps,
      decay_rate=final_temperature / init_temperature,
      end_value=final_temperature,
  )
