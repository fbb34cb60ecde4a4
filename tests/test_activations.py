"""The written-out activation derivatives the Hopper kernels' epilogues use, against jax.grad."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.activations import ACTIVATIONS, DERIVATIVES


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_derivative_matches_autodiff(name):
  fn = ACTIVATIONS[name]
  assert fn in DERIVATIVES  # every named activation can be fused
  x = jnp.concatenate([jax.random.normal(jax.random.key(0), (4096,)) * 3,
                       jnp.array([0.0, -1e-3, 1e-3, -8.0, 8.0, -30.0, 30.0])])
  want = jax.vmap(jax.grad(fn))(x)
  np.testing.assert_allclose(DERIVATIVES[fn](x), want, rtol=1e-5, atol=1e-5)  # derivatives are O(1)


def _float64(fn, x):
  x = np.asarray(x, np.float64)
  if fn is jax.nn.gelu:
    return x / (1.0 + np.exp(-2.0 * np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))  # = 0.5 x (1 + tanh u)
  if fn is jax.nn.silu:
    return x / (1.0 + np.exp(-x))
  return np.maximum(x, 0.0)


def test_plain_forms_match():
  """The kernels' forms (exp and rsqrt instead of tanh and division) are the same functions:
  against float64 they are within float32 rounding (1e-5) everywhere, including the negative tail where
  jax.nn.gelu's 1 + tanh(u) cancels (and within that form's absolute error of it); 0 maps to 0."""
  from sparsejax.activations import PLAIN
  x = jnp.concatenate([jax.random.normal(jax.random.key(1), (1024,)) * 3,
                       jnp.array([0.0, -1e-3, 1e-3, -8.0, 8.0, -30.0, 30.0, -100.0, 100.0, -1e4, 1e4])])
  with np.errstate(over="ignore"):
    for fn, plain in PLAIN.items():
      want = _float64(fn, x)
      np.testing.assert_allclose(plain(x), want, rtol=1e-5, atol=1e-30)
      np.testing.assert_allclose(plain(x), fn(x), rtol=2e-6, atol=1e-6)
      assert plain(jnp.zeros(())) == 0


def test_value_and_derivative_forms_are_the_plain_form_and_its_derivative():
  """The one-sigmoid pairs the forward epilogue stores (act(x), act'(x)) are exactly PLAIN's form and
  DERIVATIVES' (the same float32 operations), for every activation the kernels fuse."""
  from sparsejax.activations import PLAIN, VALUE_AND_DERIVATIVE
  from sparsejax.kernels.gmm.mlp import FUSED
  assert set(VALUE_AND_DERIVATIVE) == set(FUSED)
  x = jnp.concatenate([jax.random.normal(jax.random.key(2), (4096,)) * 3,
                       jnp.array([0.0, -1e-3, 1e-3, -8.0, 8.0, -30.0, 30.0, -1e4, 1e4])])
  for fn, both in VALUE_AND_DERIVATIVE.items():
    value, derivative = jax.jit(both)(x)
    np.testing.assert_allclose(value, jax.jit(PLAIN[fn])(x), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(derivative, jax.jit(DERIVATIVES[fn])(x), rtol=1e-6, atol=1e-7)
    assert both(jnp.zeros(()))[0] == 0
