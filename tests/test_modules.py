"""Flax NNX modules: MoE, Router, MLP."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import sparsejax as sj
from moe_testing import assert_close, rand

D, F, E = 8, 16, 4
STAT_FIELDS = ("tokens_per_expert", "num_dropped", "dropped_fraction", "load_balancing_loss",
               "router_z_loss", "aux_loss")

CONFIGS = {
    "top1_dropless": dict(top_k=1),
    "top2_dropless_glu": dict(top_k=2, glu=True, activation="silu"),
    "top2_capacity": dict(top_k=2, capacity_factor=1.0),
    "top1_capacity_glu_small": dict(top_k=1, capacity_factor=0.5, glu=True),
    "expert_choice": dict(router="expert_choice", capacity_factor=1.0),
    "expert_choice_glu": dict(router="expert_choice", capacity_factor=2.0, glu=True),
    "dts": dict(router="dense_to_sparse", dts_threshold=0.05),
    "dts_capacity": dict(router="dense_to_sparse", dts_threshold=0.05, capacity_factor=1.0),
    "top2_reference_impl": dict(top_k=2, impl="reference"),
}


def _moe(name, seed=0, **extra):
  cfg = sj.MoEConfig(**{**dict(d_model=D, d_ff=F, num_experts=E), **CONFIGS[name], **extra})
  return sj.MoE(cfg, rngs=nnx.Rngs(seed)), cfg


def _dot(a, b):
  """a @ b in float32: a GPU's default precision for a float32 matmul is TF32 (~1e-3), no reference."""
  return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _module_reference(model: sj.MoE, cfg: sj.MoEConfig, x2, temperature=1.0):
  """What MoE must compute, from its own parameters, through the dense masked reference."""
  logits = _dot(x2.astype(jnp.float32), model.router.w[...].astype(jnp.float32))
  w_gate = None if model.w_gate is None else model.w_gate[...]
  T = x2.shape[0]
  if cfg.router == "expert_choice":
    r = sj.expert_choice_routing(logits, cfg.capacity_factor)
    ids = jnp.broadcast_to(jnp.arange(E), (T, E))
    cw = jnp.zeros((T, E)).at[r.token_ids, jnp.arange(E)[:, None]].add(r.combine_weights)
    cap = None
  else:
    if cfg.router == "top_k":
      r = sj.top_k_routing(logits, cfg.top_k)
    else:
      r = sj.dense_to_sparse_routing(logits, temperature, cfg.dts_threshold)
    ids, cw = r.expert_ids, r.combine_weights
    cap = None if cfg.capacity_factor is None else sj.capacity(T, E, ids.shape[1], cfg.capacity_factor)
  return sj.moe_mlp_reference(x2, ids, cw, model.w_in[...], model.w_out[...], w_gate=w_gate,
                              activation=cfg.activation_fn, capacity=cap), logits, r


@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_matches_reference_on_its_params(name):
  model, cfg = _moe(name, seed=len(name))
  x = jnp.asarray(rand(np.random.default_rng(len(name)), (2, 13, D)))  # [batch, seq, d]: 26 tokens
  y, stats = nnx.jit(lambda m, x: m(x, dts_temperature=0.5))(model, x)
  assert y.shape == x.shape and y.dtype == jnp.float32
  y_ref, logits, r = nnx.jit(_module_reference, static_argnums=1)(model, cfg, x.reshape(-1, D), 0.5)
  assert_close(y.reshape(-1, D), y_ref, 1e-5, name)

  assert set(STAT_FIELDS) <= set(vars(stats))
  assert stats.tokens_per_expert.shape == (E,) and stats.tokens_per_expert.dtype == jnp.int32
  for f in STAT_FIELDS[1:]:
    assert getattr(stats, f).shape == ()
  z = sj.router_z_loss(logits)
  np.testing.assert_allclose(stats.router_z_loss, z, rtol=1e-5)
  if cfg.router == "expert_choice":
    assert float(stats.load_balancing_loss) == 0.0
    C = r.token_ids.shape[1]
    np.testing.assert_array_equal(stats.tokens_per_expert, [C] * E)
    unchosen = 26 - len(set(np.asarray(r.token_ids).reshape(-1).tolist()))
    assert int(stats.num_dropped) == unchosen
  else:
    lb = sj.load_balancing_loss(r.router_probs, r.expert_ids)
    np.testing.assert_allclose(stats.load_balancing_loss, lb, rtol=1e-5)
    ids = np.asarray(r.expert_ids)
    np.testing.assert_array_equal(stats.tokens_per_expert, np.bincount(ids[ids >= 0], minlength=E))
    if cfg.capacity_factor is None:
      assert int(stats.num_dropped) == 0
  np.testing.assert_allclose(
      stats.aux_loss, cfg.load_balancing_weight * stats.load_balancing_loss + cfg.z_loss_weight * z, rtol=1e-5)
  if name == "top1_capacity_glu_small":
    assert int(stats.num_dropped) > 0  # C = ceil(0.5 * 26 / 4) = 4 < 26 tokens on 4 experts


def test_moe_bfloat16_compute(monkeypatch):
  model, cfg = _moe("top2_dropless_glu", dtype=jnp.bfloat16)
  x = jnp.asarray(rand(np.random.default_rng(1), (20, D)))
  seen = []

  def spy(x, ids, combine_weights, *args, **kwargs):
    seen.append((x.dtype, combine_weights.dtype))
    return sj.moe_mlp(x, ids, combine_weights, *args, **kwargs)

  monkeypatch.setattr(sj.modules, "moe_mlp", spy)
  y, stats = nnx.jit(lambda m, x: m(x))(model, x)
  # bf16 compute, float32 combine weights (bf16 would round them before the float32 combine).
  assert seen == [(jnp.bfloat16, jnp.float32)]
  assert y.dtype == jnp.bfloat16 and model.w_in[...].dtype == jnp.float32  # param_dtype f32
  assert stats.router_z_loss.dtype == jnp.float32
  # Against the f32 reference on the bf16-rounded input and weights.
  xb = x.astype(jnp.bfloat16).astype(jnp.float32)
  rnd = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
  logits = _dot(xb, model.router.w[...])
  r = sj.top_k_routing(logits, 2)
  y_ref = sj.moe_mlp_reference(xb, r.expert_ids, r.combine_weights, rnd(model.w_in[...]),
                               rnd(model.w_out[...]), w_gate=rnd(model.w_gate[...]), activation=jax.nn.silu)
  assert_close(y, y_ref, 2e-2, "bf16 MoE")


def test_moe_rng_drives_jitter_and_gate_noise():
  model, _ = _moe("dts", jitter_eps=0.1)
  x = jnp.asarray(rand(np.random.default_rng(2), (16, D)))
  fwd = nnx.jit(lambda m, x: m(x))
  y0, _ = fwd(model, x)
  y0b, _ = fwd(model, x)
  np.testing.assert_array_equal(y0, y0b)  # no rng: deterministic, no noise
  noisy = nnx.jit(lambda m, x, k: m(x, rng=k))
  y1, _ = noisy(model, x, jax.random.key(1))
  y2, _ = noisy(model, x, jax.random.key(2))
  assert not np.allclose(y1, y0) and not np.allclose(y1, y2)


def test_moe_training_step_lowers_the_loss():
  model, cfg = _moe("top2_dropless_glu", seed=3)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rand(rng, (4, 16, D)))
  target = jnp.tanh(x @ jnp.asarray(rand(rng, (D, D))))
  opt = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x, target, key):
    def loss_fn(model):
      y, stats = model(x, rng=key)
      return jnp.mean((y - target) ** 2) + stats.aux_loss, stats

    (loss, stats), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads)
    return loss, stats

  w_before = np.asarray(model.w_in[...]).copy()
  router_before = np.asarray(model.router.w[...]).copy()
  losses = [float(step(model, opt, x, target, jax.random.key(i))[0]) for i in range(8)]
  assert all(np.isfinite(losses))
  assert losses[-1] < 0.7 * losses[0], losses
  assert not np.allclose(model.w_in[...], w_before)
  assert not np.allclose(model.router.w[...], router_before)  # the router is trained too


def test_parameters_carry_sharding_names():
  model, _ = _moe("top2_dropless_glu")
  specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  spec = lambda v: tuple(v.get_value() if hasattr(v, "get_value") else v.value)
  assert spec(specs["w_in"]) == ("expert", "embed", "mlp")
  assert spec(specs["w_gate"]) == ("expert", "embed", "mlp")
  assert spec(specs["w_out"]) == ("expert", "mlp", "embed")
  assert spec(specs["router"]["w"]) == (None, None)  # replicated
  mlp = sj.MLP(sj.MoEConfig(d_model=D, d_ff=F, glu=True), rngs=nnx.Rngs(0))
  mspecs = nnx.get_partition_spec(nnx.state(mlp, nnx.Param))
  assert spec(mspecs["w_in"]) == ("embed", "mlp") and spec(mspecs["w_out"]) == ("mlp", "embed")


def test_expert_weights_init_scale_per_expert_fan_in():
  model, _ = _moe("top1_dropless", d_model=64)
  std = float(np.std(np.asarray(model.w_in[...])))
  assert 0.5 / 8 < std < 1.5 / 8  # ~ 1/sqrt(d_model), not 1/sqrt(E * d_model)


def test_router_module():
  router = sj.Router(D, E, jitter_eps=0.2, rngs=nnx.Rngs(0))
  x = jnp.asarray(rand(np.random.default_rng(4), (10, D))).astype(jnp.bfloat16)
  logits = router(x)
  assert logits.shape == (10, E) and logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, _dot(x.astype(jnp.float32), router.w[...]), rtol=1e-5, atol=1e-6)
  noisy = router(x, rng=jax.random.key(0))
  assert not np.allclose(noisy, logits)


@pytest.mark.parametrize("glu", [False, True])
def test_mlp_module(glu):
  cfg = sj.MoEConfig(d_model=D, d_ff=F, glu=glu, activation="silu" if glu else "gelu")
  mlp = sj.MLP(cfg, rngs=nnx.Rngs(0))
  x = jnp.asarray(rand(np.random.default_rng(5), (3, 5, D)))
  y, stats = nnx.jit(lambda m, x: m(x))(mlp, x)
  assert y.shape == x.shape
  h = _dot(x, mlp.w_in[...])
  h = jax.nn.silu(_dot(x, mlp.w_gate[...])) * h if glu else jax.nn.gelu(h)
  np.testing.assert_allclose(y, _dot(h, mlp.w_out[...]), rtol=1e-5, atol=1e-6)
  assert set(STAT_FIELDS) <= set(vars(stats))
  assert int(stats.tokens_per_expert[0]) == 15 and float(stats.aux_loss) == 0.0
  # A dense MLP is an MoE with one expert and top-1 routing with weight 1.
  y_moe = sj.moe_mlp_reference(x.reshape(-1, D), jnp.zeros((15, 1), jnp.int32), jnp.ones((15, 1)),
                               mlp.w_in[...][None], mlp.w_out[...][None],
                               w_gate=None if not glu else mlp.w_gate[...][None], activation=cfg.activation_fn)
  assert_close(y.reshape(-1, D), y_moe, 1e-5, "MLP as one expert")


def test_moe_pending_is_refused_where_the_router_cannot_add_it():
  """pending (a decode step's W_o parts for the router's kernel to add) outside a decode step, or where
  takes_pending does not hold (here: the CPU's XLA router), is one clear error, not a silent wrong answer."""
  from sparsejax.models.transformer import RMSNorm
  model, _ = _moe("top1_dropless")
  rng = np.random.default_rng(0)
  x, pending = jnp.asarray(rand(rng, (1, D))), jnp.asarray(rand(rng, (2, 1, D)))
  norm = RMSNorm(D, param_dtype=jnp.float32)
  assert not model.takes_pending(x)
  for kwargs in (dict(decode=False), dict(decode=True)):
    with pytest.raises(ValueError, match="pending is for a decode step") as info:
      model(x, pending=pending, norm=norm, **kwargs)
    assert "\n" not in str(info.value)
