"""Dynamic loss scaling (float16 training): the scaled step is the unscaled one bit for bit, a non-finite step is
skipped and halves S, S doubles after growth_interval finite steps, S survives a checkpoint, and run() turns it on
for float16 compute only. XLA:CPU cannot train in float16, so the step is checked here in float32 and bf16, where
a power-of-two scale is just as exact."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sparsejax import loss_scale, train
from sparsejax.checkpoint import Checkpointer
from sparsejax.loss_scale import LossScaleState, dynamic_loss_scale
from sparsejax.models import Transformer, get_preset
from sparsejax.train import TrainConfig, cast_dtypes, compute_copy, functional, make_optimizer, make_steps
from corpus_testing import write_corpus

TINY = dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, num_experts=4, max_seq_len=32)
CFG = TrainConfig(lr=1e-2, warmup=1, steps=30)


def _steps(dtype, tx, grad_accum=1, steps=3):
  """(params, metrics per step) after `steps` train steps of tiny-moe in compute dtype, through the weight copy as
  run() trains."""
  apply, params = functional(Transformer(get_preset("tiny-moe", **TINY, dtype=dtype), rngs=nnx.Rngs(0)))
  opt_state = tx.init(params)
  step, _ = make_steps(apply, tx, seed=0, with_copy=True, grad_accum=grad_accum)
  tokens = jax.random.randint(jax.random.key(0), (steps, 4, 33), 0, 256)
  copy = compute_copy(params, cast_dtypes(apply, params, tokens[0, :, :-1], rng=jax.random.key(0)))
  metrics = []
  for i in range(steps):
    params, opt_state, m, copy = step(params, opt_state, tokens[i, :, :-1], tokens[i, :, 1:], jnp.int32(i), copy)
    metrics.append(jax.device_get(m))
  return params, opt_state, metrics


@pytest.mark.parametrize("dtype,grad_accum", [("float32", 1), ("bfloat16", 1), ("bfloat16", 2)])
def test_the_scaled_step_is_the_unscaled_step_bit_for_bit(dtype, grad_accum):
  """S = 2^15 multiplies every cotangent by a power of two, which rounds nothing in float32 or bf16 (no value
  here nears their range's ends), so params, loss and gradient norm are equal, not close."""
  plain, _, m_plain = _steps(dtype, make_optimizer(CFG), grad_accum)
  scaled, state, m_scaled = _steps(dtype, make_optimizer(CFG, loss_scaling=True), grad_accum)
  for a, b in zip(m_plain, m_scaled):
    assert float(a["loss"]) == float(b["loss"]) and float(a["grad_norm"]) == float(b["grad_norm"])
    assert "loss_scale" not in a and float(b["loss_scale"]) == 2.0 ** 15
  jax.tree.map(np.testing.assert_array_equal, plain, scaled)
  assert isinstance(state, LossScaleState) and int(state.finite_steps) == 3


@pytest.mark.devices(8)
def test_on_an_expert_mesh_the_scaled_step_is_the_unscaled_step():
  """Expert parallelism (2 x 4 mesh, bf16, the weight copy): S and its count are replicated beside the sharded
  state, and the step equals the unscaled one bit for bit."""
  from jax.sharding import NamedSharding, PartitionSpec
  from sparsejax.mesh import make_expert_mesh
  from sparsejax.train import build_model, expert_parallel_state
  cfg = TrainConfig(lr=1e-2, warmup=1, steps=30, seed=0)
  model_cfg = get_preset("tiny-moe", **{**TINY, "dtype": "bfloat16", "num_experts": 8, "num_layers": 1,
                                        "moe_every": 1})
  mesh = make_expert_mesh(2, 4)
  model = build_model(cfg, model_cfg, mesh)
  apply, params = functional(model)
  tokens = jax.random.randint(jax.random.key(3), (2, 8, 33), 0, 256)
  batch = lambda a: jax.device_put(a, NamedSharding(mesh, PartitionSpec(("data", "expert"))))
  runs = []
  for tx in (make_optimizer(cfg), make_optimizer(cfg, loss_scaling=True)):
    p, o, shardings = expert_parallel_state(model, jax.tree.map(jnp.copy, params), tx, mesh, 8)
    step, _ = make_steps(apply, tx, cfg.seed, shardings=shardings, with_copy=True)
    copy = compute_copy(p, cast_dtypes(apply, p, tokens[0, :, :-1], rng=jax.random.key(0)))
    for i in range(2):
      p, o, m, copy = step(p, o, batch(tokens[i, :, :-1]), batch(tokens[i, :, 1:]), jnp.int32(i), copy)
    runs.append((p, o, m))
  (p0, _, m0), (p1, o1, m1) = runs
  jax.tree.map(np.testing.assert_array_equal, p0, p1)
  assert float(m0["loss"]) == float(m1["loss"]) and float(m1["loss_scale"]) == 2.0 ** 15
  assert o1.scale.sharding.is_fully_replicated and int(o1.finite_steps) == 2


def test_a_step_whose_scaled_backward_overflows_is_skipped_and_halves_the_scale():
  """With the head's weight 1e4 times its size, the backward's cotangents reach ~200 S: at S = 2^127 they pass
  float32's largest number, as a float16 backward overflows at a far smaller S, while S = 2^100 (and no scaling)
  stays finite. The overflowed step leaves params and AdamW's state, its step count included, as they were, halves
  S and restarts its count of finite steps; the metrics give the (finite) unscaled loss and the gradient norm of
  what was skipped."""
  tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 256)
  for init_scale, overflows in ((2.0 ** 127, True), (2.0 ** 100, False)):
    apply, params = functional(Transformer(get_preset("tiny-moe", **TINY), rngs=nnx.Rngs(0)))
    params["head"] = params["head"] * 1e4
    tx = dynamic_loss_scale(make_optimizer(CFG), init_scale=init_scale)
    state = tx.init(params)._replace(finite_steps=jnp.int32(5))
    step, _ = make_steps(apply, tx, seed=0)
    before = jax.tree.map(np.array, (params, state.inner))  # the step donates its inputs
    new_params, new_state, m = step(params, state, tokens[:, :-1], tokens[:, 1:], jnp.int32(0))
    assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"])) != overflows
    if overflows:
      jax.tree.map(np.testing.assert_array_equal, (new_params, new_state.inner), before)
      assert float(new_state.scale) == float(m["loss_scale"]) == 2.0 ** 126 and int(new_state.finite_steps) == 0
    else:
      assert int(new_state.inner[1][0].count) == 1  # chain(clip, adamw): AdamW took the step
      assert float(new_state.scale) == 2.0 ** 100 and int(new_state.finite_steps) == 6


def test_the_scale_doubles_after_growth_interval_finite_steps_and_halves_to_at_least_one():
  """On the transformation alone: the inner update where the gradients are finite, zeros and the inner state kept
  where not; S: 16, 16, 32 (two finite steps), 16 (a NaN), 16, 32, then from 1 a NaN leaves it at 1."""
  tx = dynamic_loss_scale(optax.adam(0.1), init_scale=16.0, growth_interval=2)
  params = {"w": jnp.arange(3.0), "b": jnp.ones(())}
  state = tx.init(params)
  g = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}
  bad = {"w": jnp.array([1.0, jnp.nan, 3.0]), "b": jnp.array(0.5)}
  scales = []
  for grads in (g, g, bad, g, g):
    before = state
    updates, state = tx.update(grads, state, params)
    if grads is bad:
      assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(updates))
      jax.tree.map(np.testing.assert_array_equal, state.inner, before.inner)
    else:
      want, _ = optax.adam(0.1).update(grads, before.inner, params)
      jax.tree.map(np.testing.assert_array_equal, updates, want)
    scales.append(float(state.scale))
  assert scales == [16.0, 32.0, 16.0, 16.0, 32.0]
  one = dynamic_loss_scale(optax.sgd(0.1), init_scale=1.0)
  _, s = one.update(bad, one.init(params), params)
  assert float(s.scale) == 1.0


def test_the_scale_survives_a_checkpoint(tmp_path):
  tx = dynamic_loss_scale(make_optimizer(CFG), init_scale=2.0 ** 10, growth_interval=1)
  _, state, _ = _steps("float32", tx, steps=2)
  assert float(state.scale) == 2.0 ** 12
  apply, params = functional(Transformer(get_preset("tiny-moe", **TINY), rngs=nnx.Rngs(0)))
  ckpt = Checkpointer(tmp_path, every=1, keep=1)
  ckpt.save(2, {"params": params, "opt_state": state}, {"step": 2})
  ckpt.close()
  template = {"params": params, "opt_state": jax.tree.map(jnp.zeros_like, tx.init(params))}
  items, _ = Checkpointer(tmp_path).restore(template)
  assert isinstance(items["opt_state"], LossScaleState) and float(items["opt_state"].scale) == 2.0 ** 12


def test_make_optimizer_and_loss_scale_agree():
  params = {"w": jnp.ones((2, 2))}
  assert loss_scale.loss_scale(make_optimizer(CFG).init(params)) is None
  assert float(loss_scale.loss_scale(make_optimizer(CFG, loss_scaling=True).init(params))) == 2.0 ** 15


@pytest.mark.parametrize("dtype,scaled", [("float16", True), ("bfloat16", False), ("float32", False)])
def test_run_scales_the_loss_for_float16_compute_only(tmp_path, monkeypatch, dtype, scaled):
  """run() builds its optimizer with loss scaling exactly when the model computes in float16 (float16 itself
  cannot compile on the CPU, so the run stops once the optimizer is built)."""
  cfg = TrainConfig(preset="tiny-moe", data=write_corpus(tmp_path, docs=4, words_per_doc=200),
                    out=str(tmp_path / "run"), steps=2, batch_size=2, seq_len=16, progress=False,
                    model_overrides=TINY)
  plan = train.prepare(cfg)
  plan = dataclasses.replace(plan, model_cfg=plan.model_cfg.replace(dtype=dtype))
  seen = []

  def record(cfg, **kw):
    seen.append(kw.get("loss_scaling", False))
    raise KeyboardInterrupt  # stop here: nothing after the optimizer is under test

  monkeypatch.setattr(train, "make_optimizer", record)
  with pytest.raises(KeyboardInterrupt):
    train.run(plan)
  assert seen == [scaled]


@pytest.mark.parametrize("kw,message", [
    (dict(init_scale=3.0), "init_scale must be a power of two"),
    (dict(init_scale=0.5), "init_scale must be a power of two"),
    (dict(factor=1.0), "factor must be a power of two > 1"),
    (dict(factor=3.0), "factor must be a power of two > 1"),
    (dict(growth_interval=0), "growth_interval must be an integer >= 1"),
    (dict(growth_interval=2.5), "growth_interval must be an integer >= 1"),
])
def test_bad_arguments_are_one_line_errors(kw, message):
  with pytest.raises(ValueError, match=message) as e:
    dynamic_loss_scale(optax.sgd(0.1), **kw)
  assert "\n" not in str(e.value)
