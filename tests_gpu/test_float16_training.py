"""float16 training compiled on a GPU: the loss-scaled step trains as bf16 does. (XLA:CPU cannot compile float16,
so tests/test_loss_scale.py checks the scaling in float32 and bf16; this is its float16 half.)

  JAX_PLATFORMS=cuda python -m pytest -q tests_gpu/test_float16_training.py
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparsejax.models import Transformer, get_preset
from sparsejax.train import TrainConfig, cast_dtypes, compute_copy, functional, make_optimizer, make_steps

TINY = dict(d_model=128, num_layers=2, num_heads=4, d_ff=256, num_experts=8, max_seq_len=128)


def _losses(dtype: str, steps: int = 40):
  """Losses of `steps` train steps on one fixed batch of 16 x 128 tokens, as run() trains (weight copy, loss
  scaling where the compute dtype is float16), and the final loss scale (None without scaling)."""
  apply, params = functional(Transformer(get_preset("tiny-moe", **TINY, dtype=dtype), rngs=nnx.Rngs(0)))
  tx = make_optimizer(TrainConfig(lr=3e-3, warmup=5, steps=steps), loss_scaling=dtype == "float16")
  opt_state = tx.init(params)
  step, _ = make_steps(apply, tx, seed=0, with_copy=True)
  tokens = jax.random.randint(jax.random.key(0), (16, 129), 0, 256)
  x, y = tokens[:, :-1], tokens[:, 1:]
  copy = compute_copy(params, cast_dtypes(apply, params, x, rng=jax.random.key(0)))
  losses = []
  for i in range(steps):
    params, opt_state, m, copy = step(params, opt_state, x, y, jnp.int32(i), copy)
    losses.append(float(m["loss"]))
  return np.array(losses), (float(m["loss_scale"]) if "loss_scale" in m else None)


def test_float16_with_loss_scaling_trains_as_bf16_does():
  """Every float16 loss is finite, S stays at 2^15 (nothing overflowed at this size), and the curve falls as bf16's
  does: within 5% of it at every step, 40 steps on one batch."""
  f16, scale = _losses("float16")
  bf16, no_scale = _losses("bfloat16")
  assert np.all(np.isfinite(f16)) and scale == 2.0 ** 15 and no_scale is None
  assert f16[-1] < 0.8 * f16[0], f16
  assert np.all(np.abs(f16 - bf16) <= 0.05 * bf16), np.stack([f16, bf16])
