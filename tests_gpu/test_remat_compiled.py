"""TransformerConfig.remat compiled on a GPU: the recomputed backward (through the GPU kernels, cuDNN attention in
bf16) gives the gradients of the step without remat. tests/test_model.py checks the same on the CPU in float32.

  JAX_PLATFORMS=cuda python -m pytest -q tests_gpu/test_remat_compiled.py
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsejax.models import Transformer, cross_entropy, get_preset
from sparsejax.train import functional

TINY = dict(d_model=128, num_layers=4, num_heads=4, d_ff=256, num_experts=8, max_seq_len=256, jitter_eps=0.1)


def _loss_and_grads(dtype: str, remat: str):
  apply, params = functional(Transformer(get_preset("tiny-moe", **TINY, dtype=dtype, remat=remat),
                                         rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(1), (8, 257), 0, 256)

  def loss(p):
    logits, stats = apply(p, tokens[:, :-1], rng=jax.random.key(2))
    return cross_entropy(logits, tokens[:, 1:]) + stats.aux_loss

  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("remat", ["ffn", "hidden", "block"])
def test_remat_gradients_equal_the_step_without_it(remat):
  """float32: the same gradients (1e-5, normwise a leaf). bf16 rounds the recomputed forward as XLA fuses it, which
  can flip a near-tied token's expert (bf16 against float32 moves expert gradients by several %), so there each leaf's
  error against the float32 gradients may be at most twice the bf16 step's without remat (or 1e-2)."""
  want_loss, want = _loss_and_grads("float32", "none")
  loss, got = _loss_and_grads("float32", remat)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  err = lambda g, w: float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert err(g, w) <= 1e-5, (remat, err(g, w))
  (base_loss, base), (loss, got) = _loss_and_grads("bfloat16", "none"), _loss_and_grads("bfloat16", remat)
  np.testing.assert_allclose(loss, base_loss, rtol=1e-2)
  for (path, g), b, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(base), jax.tree.leaves(want)):
    assert err(g, w) <= max(2 * err(b, w), 1e-2), (remat, jax.tree_util.keystr(path), err(g, w), err(b, w))
