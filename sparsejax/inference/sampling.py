"""Choosing the next token from logits: greedy, temperature, top-k and nucleus (top-p) sampling."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class Sampling:
  """temperature=0 is greedy (argmax). top_k keeps the k likeliest tokens, top_p the smallest set of
  likeliest tokens whose probability reaches p (Holtzman et al. 2020); None keeps all."""
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    t = self.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
      raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {t!r}.")
    k = self.top_k
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
      raise ValueError(f"top_k must be an int >= 1 or None; got {k!r}.")
    p = self.top_p
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
      raise ValueError(f"top_p must lie in (0, 1] or be None; got {p!r}.")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def sample_logits(logits: Float[Array, "b vocab"], key: jax.Array, sampling: Sampling) -> Int[Array, "b"]:
  """next[b] ~ softmax(z[b] / T) restricted to the top-k / top-p set; argmax(z[b]) when T = 0."""
  if sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  z = logits.astype(jnp.float32) / sampling.temperature
  if sampling.top_k is not None and sampling.top_k < z.shape[-1]:
    kth = jax.lax.top_k(z, sampling.top_k)[0][:, -1:]
    z = jnp.where(z < kth, -jnp.inf, z)
  if sampling.top_p is not None and sampling.top_p < 1:
    zs = -jnp.sort(-z, axis=-1)
    p = jax.nn.softmax(zs, axis=-1)
    # A token stays if the mass strictly before it is below p: the likeliest one always stays.
    keep = (jnp.cumsum(p, axis=-1) - p) < sampling.top_p
    cutoff = jnp.min(jnp.where(keep, zs, jnp.inf), axis=-1, keepdims=True)
    z = jnp.where(z < cutoff, -jnp.inf, z)
  return jax.random.categorical(key, z, axis=-1).astype(jnp.int32)
