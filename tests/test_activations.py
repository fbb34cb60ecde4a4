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


def test_plain_forms_match():
  from sparsejax.activations import PLAIN
  x = jax.random.normal(jax.random.key(1), (1024,)) * 3
  for fn, plain in PLAIN.items():
    np.testing.assert_array_equal(plain(x), fn(x))
