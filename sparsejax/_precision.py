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


# A float32 product in six bf16 passes on the tensor cores (each operand split as hi + mid + lo),
# for the float32 dots that bf16 models run: the router's. On an H100 (E64 top-1's router, forward
# and both gradients) it took 0.138 ms against 0.214 for HIGHEST (float32 cores) and 0.077 for
# TF32, with 1e-7 relative error against float64 where HIGHEST gave 6e-7 and TF32 2e-4
# (experiments/results/router_precision_H100.log). The CPU computes it as a float32 dot.
FLOAT32_BY_BF16_PASSES = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6


def float32_by_bf16_passes():
  """FLOAT32_BY_BF16_PASSES, or HIGHEST on a GPU before sm_80 (T4, V100). XLA:GPU refuses the bf16-pass
  algorithms there ("Unsupported algorithm on the current device", xla/service/algorithm_util.cc: bf16
  tensor cores start at sm_80), and with no TF32 either a float32 dot is already exact at HIGHEST."""
  from sparsejax import kernels  # the GPU's generation; the module reads it when called, so tests can set it

  return jax.lax.Precision.HIGHEST if kernels.gpu_before_ampere() else FLOAT32_BY_BF16_PASSES


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
