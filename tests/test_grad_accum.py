"""Gradient accumulation (`--grad-accum A`, make_steps(grad_accum=A)): one AdamW update from the mean
gradient of A microbatches (rows i, i + A, ... of the batch), its loss and stats their means, its
expert counts their sums; the same on an expert mesh as on one device; bad values are one line."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sparsejax.models import Transformer, cross_entropy, get_preset
from sparsejax.train import (TrainConfig, cast_dtypes, compute_copy, functional, make_optimizer, make_steps,
                             prepare, train)
from corpus_testing import write_corpus

TINY = dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, num_experts=4, max_seq_len=32)


def _model(preset, **overrides):
  return functional(Transformer(get_preset(preset, **{**TINY, **overrides}), rngs=nnx.Rngs(0)))


def _batch(rows, seed=0):
  tok = jax.random.randint(jax.random.key(seed), (rows, 33), 0, 256)
  return tok[:, :-1], tok[:, 1:]


# An "optimizer" whose state is the last gradient it was given (and that moves nothing).
KEEP_GRADS = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                          lambda g, state, params=None: (jax.tree.map(jnp.zeros_like, g), g))


def _grad_step(apply, params, x, y, grad_accum):
  """(the gradient the step hands its optimizer, the step's metrics)."""
  step, _ = make_steps(apply, KEEP_GRADS, seed=0, grad_accum=grad_accum)
  mine = jax.tree.map(jnp.copy, params)  # the step donates its params
  _, grads, m = step(mine, KEEP_GRADS.init(mine), x, y, jnp.int32(0))
  return grads, m


def _close(a, b, rtol):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=rtol * float(jnp.max(jnp.abs(v))))


def test_a_dense_model_gets_the_full_batch_gradient():
  """Cross-entropy is a mean over tokens, so the mean over equal microbatches is the batch's: the
  accumulated step applies the one-batch gradient and logs the one-batch loss (float32 rounding)."""
  apply, params = _model("tiny-dense")
  x, y = _batch(8)
  g1, m1 = _grad_step(apply, params, x, y, 1)
  g4, m4 = _grad_step(apply, params, x, y, 4)
  _close(g4, g1, 1e-5)
  assert float(m4["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-6)
  assert float(m4["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=1e-5)


def test_evaluation_runs_microbatches_and_gives_the_batch_loss():
  apply, params = _model("tiny-moe")
  x, y = _batch(8, seed=3)
  _, whole = make_steps(apply, KEEP_GRADS, seed=0)
  _, parts = make_steps(apply, KEEP_GRADS, seed=0, grad_accum=4)
  assert float(parts(params, x, y)) == pytest.approx(float(whole(params, x, y)), rel=1e-6)


def test_an_moe_step_averages_its_microbatches():
  """MoE: the aux losses are each microbatch's own, so the step's gradient is the mean of A
  independent jax.grads over rows i::A (fold_in(rng, i) for each); the loss and the float stats are
  their means, tokens_per_expert their sum, which equals the whole batch's routing counts."""
  cfg = get_preset("tiny-moe", **{**TINY, "moe_every": 1, "load_balancing_weight": 0.5, "z_loss_weight": 0.1,
                                  "jitter_eps": 0.1})
  apply, params = functional(Transformer(cfg, rngs=nnx.Rngs(0)))
  x, y = _batch(6, seed=1)
  grads, m = _grad_step(apply, params, x, y, 3)
  rng = jax.random.fold_in(jax.random.key(0), 0)  # make_steps' rng of step 0

  def loss(p, xb, yb, r):
    logits, stats = apply(p, xb, rng=r)
    return cross_entropy(logits, yb) + stats.aux_loss, stats

  # One compile serves the three microbatches (eager grads of the model dispatch op by op).
  grad = jax.jit(jax.grad(loss, has_aux=True))
  parts = [grad(params, x[i::3], y[i::3], jax.random.fold_in(rng, i)) for i in range(3)]
  want = jax.tree.map(lambda *g: sum(g) / 3, *[g for g, _ in parts])
  _close(grads, want, 1e-5)
  stats = [s for _, s in parts]
  assert float(m["aux_loss"]) == pytest.approx(np.mean([float(s.aux_loss) for s in stats]), rel=1e-5)
  np.testing.assert_array_equal(m["tokens_per_expert"], sum(np.asarray(s.tokens_per_expert) for s in stats))
  assert int(m["tokens_per_expert"].sum()) == 2 * 6 * 32  # two MoE layers, every token routed once


def test_with_the_compute_copy_the_accumulated_step_is_unchanged():
  """bf16 compute over float32 params: the step that reads the optimizer's bf16 copy gives the
  accumulated step's numbers bit for bit (each microbatch's bf16 gradient upcast before the sum)."""
  apply, params = _model("tiny-moe", dtype="bfloat16", param_dtype="float32", glu=True)
  tx = make_optimizer(TrainConfig(lr=1e-2, warmup=1, steps=30))
  x, y = _batch(4, seed=2)
  old, _ = make_steps(apply, tx, seed=0, grad_accum=2)
  new, _ = make_steps(apply, tx, seed=0, with_copy=True, grad_accum=2)
  a = jax.tree.map(jnp.copy, (params, tx.init(params)))
  b = jax.tree.map(jnp.copy, (params, tx.init(params)))
  copy = compute_copy(b[0], cast_dtypes(apply, params, x, rng=jax.random.key(0)))
  assert jax.tree.leaves(copy)
  for i in range(2):
    *a, ma = old(*a, x, y, jnp.int32(i))
    *b, mb, copy = new(*b, x, y, jnp.int32(i), copy)
  for u, v in zip(jax.tree.leaves((a, ma)), jax.tree.leaves((b, mb)), strict=True):
    assert np.array_equal(np.asarray(u), np.asarray(v))


def _cfg(tmp_path, name, **kw):
  base = dict(preset="tiny-moe", data=write_corpus(tmp_path), out=str(tmp_path / name), steps=3, batch_size=8,
              seq_len=16, warmup=1, eval_every=0, eval_batches=1, ckpt_every=0, log_every=1, progress=False,
              model_overrides=dict(TINY, num_layers=1, num_experts=8, moe_every=1, max_seq_len=16, dtype="float32"))
  return TrainConfig(**{**base, **kw})


def _records(out):
  return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
          if json.loads(line)["kind"] == "train"]


@pytest.mark.devices(8)
def test_the_training_loop_on_an_expert_mesh_follows_one_device(tmp_path):
  """--grad-accum 2 with --mesh data=2,expert=4: the losses of the one-device run with the same
  accumulation, and each logged step routed all batch_size x seq_len tokens."""
  train(_cfg(tmp_path, "one", batch_size=16, grad_accum=2))
  train(_cfg(tmp_path, "mesh", batch_size=16, grad_accum=2, mesh="data=2,expert=4"))
  one, mesh = _records(tmp_path / "one"), _records(tmp_path / "mesh")
  np.testing.assert_allclose([r["loss"] for r in mesh], [r["loss"] for r in one], rtol=2e-5)
  assert all(sum(map(sum, r["tokens_per_expert"])) == 16 * 16 for r in one + mesh)


@pytest.mark.parametrize("kw, error", [
    (dict(grad_accum=0), "--grad-accum must be an integer >= 1; got 0"),
    (dict(batch_size=6, grad_accum=4), "--batch-size 6 does not split into --grad-accum 4 microbatches"),
])
def test_bad_values_are_one_line(tmp_path, kw, error):
  with pytest.raises(ValueError, match=error):
    _cfg(tmp_path, "run", **kw)


@pytest.mark.devices(8)
def test_a_microbatch_that_does_not_split_over_the_mesh_fails_before_compiling(tmp_path):
  cfg = _cfg(tmp_path, "run", batch_size=8, grad_accum=2, mesh="data=1,expert=8")
  with pytest.raises(ValueError, match="A microbatch of --batch-size 8 / --grad-accum 2 does not split over "
                                       "the 8 devices of --mesh data=1,expert=8: pass a --batch-size that is a "
                                       "multiple of 16"):
    prepare(cfg)
  assert not (tmp_path / "run").exists()
