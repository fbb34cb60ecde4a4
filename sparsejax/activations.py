"""The feed-forward activations by name, each with its derivative written out.

The Hopper kernels apply an activation and its derivative inside their epilogues, where the
derivative cannot come from autodiff (Mosaic GPU lowers no `add_any`, which the JVP of x * cdf(x)
produces). So each activation here carries its derivative as plain elementwise math; the tests
check it against jax.grad. Which of them a kernel can fuse depends on what its backend lowers
(sparsejax.kernels.gmm.mlp); any other activation still works everywhere, unfused.

The sigmoid-shaped ones (tanh-GELU, SiLU) and their derivatives are written with exp and rsqrt
only: 0.5 (1 + tanh(u)) = sigmoid(2u), and sigmoid(z) = rsqrt(1 + e^-z)^2. In a kernel compiled
with approximate math those are one special-function instruction each, where libdevice's tanhf
and an IEEE float32 division take a dozen or more; the epilogues of the Hopper kernels were
bound by issuing such instructions (experiments/notes_hopper_kernels.md). Both are accurate to
float32 rounding (no cancellation in 1 + tanh(u) for negative u either).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_exact(x):
  """x Phi(x), Phi the standard normal CDF."""
  return jax.nn.gelu(x, approximate=False)


def _sigmoid(z):
  """1 / (1 + e^-z) as rsqrt(1 + e^-z)^2: no division, and 0 (not NaN) where e^-z overflows."""
  r = jax.lax.rsqrt(1.0 + jnp.exp(-z))
  return r * r


def _gelu_tanh_u(x):
  return _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)


def _gelu_tanh(x):
  """0.5 x (1 + tanh(u)) = x sigmoid(2u), u = c (x + 0.044715 x^3): jax.nn.gelu's tanh form."""
  return x * _sigmoid(2.0 * _gelu_tanh_u(x))


def _gelu_tanh_derivative(x):
  """d/dx x s(2u) = s + 2 x s (1 - s) du/dx, s = sigmoid(2u), du/dx = c (1 + 3 * 0.044715 x^2)."""
  s = _sigmoid(2.0 * _gelu_tanh_u(x))
  du = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
  return s + 2.0 * x * s * (1.0 - s) * du


def _gelu_exact_derivative(x):
  """Phi(x) + x phi(x)."""
  return 0.5 * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0)))) + x * jnp.exp(-0.5 * x * x) * (
      1.0 / math.sqrt(2.0 * math.pi))


def _silu(x):
  """x sigmoid(x)."""
  return x * _sigmoid(x)


def _silu_derivative(x):
  """s (1 + x (1 - s)), s = sigmoid(x)."""
  s = _sigmoid(x)
  return s * (1.0 + x * (1.0 - s))


def _gelu_tanh_and_derivative(x):
  """(_gelu_tanh(x), _gelu_tanh_derivative(x)), one sigmoid for both."""
  s = _sigmoid(2.0 * _gelu_tanh_u(x))
  du = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
  return x * s, s + 2.0 * x * s * (1.0 - s) * du


def _silu_and_derivative(x):
  """(_silu(x), _silu_derivative(x)), one sigmoid for both."""
  s = _sigmoid(x)
  return x * s, s * (1.0 + x * (1.0 - s))


def _relu_derivative(x):
  """1 where x > 0, else 0 (jax.nn.relu's choice at 0)."""
  return jnp.where(x > 0, 1.0, 0.0).astype(x.dtype)


ACTIVATIONS = {
    "gelu": jax.nn.gelu,  # the tanh approximation, jax's default
    "gelu_exact": gelu_exact,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}

# What a kernel body computes for an activation: primitives, not custom_jvp wrappers, and for the
# sigmoid-shaped ones the exp/rsqrt forms above. Each maps 0 to 0 (the kernels rely on it to leave
# padding rows zero).
PLAIN = {jax.nn.relu: lambda x: jnp.maximum(x, 0.0), jax.nn.gelu: _gelu_tanh, jax.nn.silu: _silu}

DERIVATIVES = {
    jax.nn.gelu: _gelu_tanh_derivative,
    gelu_exact: _gelu_exact_derivative,
    jax.nn.relu: _relu_derivative,
    jax.nn.silu: _silu_derivative,
}

# A kernel form's value and derivative from one evaluation of their shared part (the sigmoid): an
# epilogue that stores both pays for the special functions once (sparsejax.kernels.gmm.mlp).
VALUE_AND_DERIVATIVE = {
    jax.nn.gelu: _gelu_tanh_and_derivative,
    jax.nn.silu: _silu_and_derivative,
    jax.nn.relu: lambda x: (jnp.maximum(x, 0.0), _relu_derivative(x)),
}
