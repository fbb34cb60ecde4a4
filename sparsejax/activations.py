"""The feed-forward activations by name, each with its derivative written out.

The Hopper kernels apply an activation and its derivative inside their epilogues, where the
derivative cannot come from autodiff (Mosaic GPU lowers no `add_any`, which the JVP of x * cdf(x)
produces). So each activation here carries its derivative as plain elementwise math; the tests
check it against jax.grad. Which of them a kernel can fuse depends on what its backend lowers
(sparsejax.kernels.gmm.mlp); any other activation still works everywhere, unfused.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_exact(x):
  """x Phi(x), Phi the standard normal CDF."""
  return jax.nn.gelu(x, approximate=False)


def _gelu_tanh_derivative(x):
  """d/dx 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3): 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx."""
  t = jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
  du = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du


def _gelu_exact_derivative(x):
  """Phi(x) + x phi(x)."""
  return 0.5 * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0)))) + x * jnp.exp(-0.5 * x * x) * (
      1.0 / math.sqrt(2.0 * math.pi))


def _silu_derivative(x):
  """s (1 + x (1 - s)), s = sigmoid(x)."""
  s = jax.nn.sigmoid(x)
  return s * (1.0 + x * (1.0 - s))


def _relu_derivative(x):
  """1 where x > 0, else 0 (jax.nn.relu's choice at 0)."""
  return jnp.where(x > 0, 1.0, 0.0).astype(x.dtype)


ACTIVATIONS = {
    "gelu": jax.nn.gelu,  # the tanh approximation, jax's default
    "gelu_exact": gelu_exact,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}

# Kernel bodies lower primitives, not custom_jvp wrappers: the plain form of such an activation.
PLAIN = {jax.nn.relu: lambda x: jnp.maximum(x, 0.0)}

DERIVATIVES = {
    jax.nn.gelu: _gelu_tanh_derivative,
    gelu_exact: _gelu_exact_derivative,
    jax.nn.relu: _relu_derivative,
    jax.nn.silu: _silu_derivative,
}
