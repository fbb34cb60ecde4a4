"""The precision the library's XLA dots ask for: float32 stays float32 on every backend.

A GPU runs a float32 dot at XLA's default precision as TF32 (10-bit mantissas, about 1e-3
relative), which the CPU cannot show. Float32 inputs must give float32 answers, so the float32
dots ask for HIGHEST; half-precision dots keep the default (None), so bf16 programs are exactly
the programs they would be without these helpers.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


def dot_precision(*operands):
  """HIGHEST when the operands (arrays or dtypes) promote to float32 or wider, else None."""
  dtype = jnp.result_type(*operands)
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits >= 32:
    return jax.lax.Precision.HIGHEST
  return None


def full_precision(precision, *operands):
  """precision as given (a caller's explicit choice wins), or where it is None, dot_precision."""
  if precision is not None:
    return tuple(precision) if isinstance(precision, list) else precision
  return dot_precision(*operands)


def dot_precision_scope(*operands):
  """A context in which dots traced with no precision get dot_precision(*operands): for library
  calls that take no precision argument (jax.nn.dot_product_attention). Half precision enters
  no context, so its programs stay as they were."""
  if dot_precision(*operands) is None:
    return contextlib.nullcontext()
  return jax.default_matmul_precision("highest")
