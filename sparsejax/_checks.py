"""Trace-time input checks shared by the functional core.

Every check reads only static facts (shapes, dtypes, Python numbers), so a bad call fails
when it is traced, with a message that names the argument, instead of deep inside XLA.
"""
from __future__ import annotations

import jax.numpy as jnp


def check_rank(name: str, x, rank: int, layout: str) -> None:
  if jnp.ndim(x) != rank:
    raise ValueError(f"{name} must have rank {rank} ({layout}); got shape {jnp.shape(x)}.")


def check_tokens(name: str, x) -> None:
  """x [tokens, ...] holds at least one token: with none, a layer's placement fails deep inside and a mean over
  tokens is NaN."""
  if jnp.shape(x)[0] == 0:
    raise ValueError(f"{name} has no tokens (shape {jnp.shape(x)}); pass at least one.")


def check_floating(name: str, x) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"{name} must be a floating-point array; got dtype {jnp.result_type(x)}.")


def check_integer(name: str, x) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
    raise TypeError(f"{name} must be an integer array; got dtype {jnp.result_type(x)}.")


def check_same_dtype(**arrays) -> None:
  dtypes = {name: jnp.result_type(a) for name, a in arrays.items() if a is not None}
  if len(set(dtypes.values())) > 1:
    listed = ", ".join(f"{n}={d}" for n, d in dtypes.items())
    raise TypeError(f"dtypes must match ({listed}); cast them first.")


def check_router(x, w_router) -> None:
  """x [tokens, d_model] and w_router [d_model, experts], both floating, of one d_model."""
  check_rank("x", x, 2, "[tokens, d_model]")
  check_rank("w_router", w_router, 2, "[d_model, experts]")
  check_floating("x", x)
  check_floating("w_router", w_router)
  if x.shape[1] != w_router.shape[0]:
    raise ValueError(f"x has d_model={x.shape[1]} but w_router expects {w_router.shape[0]}.")


def check_top_k(k, num_experts: int) -> None:
  if not isinstance(k, int) or isinstance(k, bool):
    raise TypeError(f"k must be a Python int; got {k!r}.")
  if k < 1:
    raise ValueError(f"k must be >= 1; got {k}.")
  if k > num_experts:
    raise ValueError(f"k={k} exceeds the number of experts ({num_experts}).")


def check_activation(activation) -> None:
  """A layer's activation is a function (MoEConfig, a config, takes its name)."""
  if not callable(activation):
    raise TypeError(f"activation must be a function such as jax.nn.silu; got {activation!r} (names such as "
                    "'silu' are for MoEConfig(activation=...)).")


def check_positive(name: str, value) -> None:
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    raise TypeError(f"{name} must be a Python number; got {value!r}.")
  if not value > 0:
    raise ValueError(f"{name} must be > 0; got {value}.")
