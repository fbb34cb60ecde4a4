"""Bad input fails at trace time with a message naming the problem (checked eagerly and under jit)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import sparsejax as sj

T, E, K, D, F = 6, 4, 2, 8, 16
f32 = jnp.float32


def _ok():
  x = jnp.ones((T, D), f32)
  ids = jnp.zeros((T, K), jnp.int32).at[:, 1].set(1)
  cw = jnp.full((T, K), 0.5, f32)
  w_in, w_out, w_gate = jnp.ones((E, D, F), f32), jnp.ones((E, F, D), f32), jnp.ones((E, D, F), f32)
  return dict(x=x, expert_ids=ids, combine_weights=cw, w_in=w_in, w_out=w_out, w_gate=w_gate)


def _call_moe(kwargs, traced):
  a = dict(_ok())
  a.update(kwargs)
  opts = {n: a.pop(n) for n in ("capacity_factor", "impl", "activation") if n in a}
  arrays = {n: a[n] for n in ("x", "expert_ids", "combine_weights", "w_in", "w_out", "w_gate")}

  def f(arrays):
    return sj.moe_mlp(arrays["x"], arrays["expert_ids"], arrays["combine_weights"], arrays["w_in"],
                      arrays["w_out"], w_gate=arrays["w_gate"], **opts)

  return jax.eval_shape(f, arrays) if traced else f(arrays)


MOE_BAD = [
    ("x_d_model", dict(x=jnp.ones((T, D + 1), f32)), ValueError, r"x has d_model=9"),
    ("x_rank", dict(x=jnp.ones((1, T, D), f32)), ValueError, r"x must have rank 2"),
    ("w_out_shape", dict(w_out=jnp.ones((E, F, D + 1), f32)), ValueError, r"w_out must be \[E, d_ff, d_model\]"),
    ("w_out_experts", dict(w_out=jnp.ones((E + 1, F, D), f32)), ValueError, r"w_out must be"),
    ("w_gate_shape", dict(w_gate=jnp.ones((E, D, F + 1), f32)), ValueError, r"w_gate must have w_in's shape"),
    ("w_in_rank", dict(w_in=jnp.ones((D, F), f32)), ValueError, r"w_in must have rank 3"),
    ("ids_vs_weights", dict(combine_weights=jnp.ones((T, K + 1), f32)), ValueError,
     r"expert_ids .* and combine_weights .* must have one shape"),
    ("ids_tokens", dict(expert_ids=jnp.zeros((T + 1, K), jnp.int32),
                        combine_weights=jnp.ones((T + 1, K), f32)), ValueError, r"expert_ids has 7 tokens but x has 6"),
    ("ids_rank", dict(expert_ids=jnp.zeros((T,), jnp.int32)), ValueError, r"expert_ids must have rank 2"),
    ("k_gt_E", dict(expert_ids=jnp.zeros((T, E + 1), jnp.int32),
                    combine_weights=jnp.ones((T, E + 1), f32)), ValueError, r"k=5 exceeds the number of experts \(4\)"),
    ("k_lt_1", dict(expert_ids=jnp.zeros((T, 0), jnp.int32),
                    combine_weights=jnp.ones((T, 0), f32)), ValueError, r"k must be >= 1"),
    ("integer_x", dict(x=jnp.ones((T, D), jnp.int32)), TypeError, r"x must be a floating-point array"),
    ("float_ids", dict(expert_ids=jnp.zeros((T, K), f32)), TypeError, r"expert_ids must be an integer array"),
    ("int_weights", dict(combine_weights=jnp.ones((T, K), jnp.int32)), TypeError,
     r"combine_weights must be a floating-point array"),
    ("dtype_mismatch", dict(x=jnp.ones((T, D), jnp.bfloat16)), TypeError, r"dtypes must match"),
    ("gate_dtype_mismatch", dict(w_gate=jnp.ones((E, D, F), jnp.bfloat16)), TypeError, r"dtypes must match"),
    ("cf_zero", dict(capacity_factor=0.0), ValueError, r"capacity_factor must be > 0"),
    ("cf_negative", dict(capacity_factor=-1.0), ValueError, r"capacity_factor must be > 0"),
    ("cf_not_number", dict(capacity_factor="1.0"), TypeError, r"capacity_factor must be a Python number"),
    ("no_tokens", dict(x=jnp.ones((0, D), f32), expert_ids=jnp.zeros((0, K), jnp.int32),
                       combine_weights=jnp.ones((0, K), f32)), ValueError, r"x has no tokens \(shape \(0, 8\)\)"),
    ("no_tokens_capacity", dict(x=jnp.ones((0, D), f32), expert_ids=jnp.zeros((0, K), jnp.int32),
                                combine_weights=jnp.ones((0, K), f32), capacity_factor=1.0), ValueError,
     r"x has no tokens"),
    ("bad_impl", dict(impl="cuda"), ValueError, r"impl must be one of"),
    ("activation_name", dict(activation="silu"), TypeError, r"activation must be a function such as jax.nn.silu"),
    ("bad_impl_capacity", dict(impl="cuda", capacity_factor=1.0), ValueError, r"impl must be one of"),
]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("name,kwargs,exc,match", MOE_BAD, ids=[c[0] for c in MOE_BAD])
def test_moe_mlp_rejects(name, kwargs, exc, match, traced):
  with pytest.raises(exc, match=match):
    _call_moe(kwargs, traced)


def test_moe_mlp_accepts_the_good_call():
  """The base call of the table above is valid, so each rejection is caused by its one change."""
  y, _ = _call_moe({}, traced=False)
  assert y.shape == (T, D)
  y, _ = _call_moe(dict(capacity_factor=1.0, impl="reference"), traced=True)
  assert y.shape == (T, D)


GMM_BAD = [
    ("gs_length", dict(group_sizes=jnp.ones((E + 1,), jnp.int32)), ValueError,
     r"group_sizes has 5 entries but rhs has 4 groups"),
    ("gs_rank", dict(group_sizes=jnp.ones((1, E), jnp.int32)), ValueError, r"group_sizes must have rank 1"),
    ("gs_float", dict(group_sizes=jnp.ones((E,), f32)), TypeError, r"group_sizes must be an integer array"),
    ("K_mismatch", dict(lhs=jnp.ones((T, D + 1), f32)), ValueError, r"lhs has K=9 but rhs has K=8"),
    ("lhs_rank", dict(lhs=jnp.ones((T,), f32)), ValueError, r"lhs must have rank 2"),
    ("rhs_rank", dict(rhs=jnp.ones((D, F), f32)), ValueError, r"rhs must have rank 3"),
    ("integer_lhs", dict(lhs=jnp.ones((T, D), jnp.int32), rhs=jnp.ones((E, D, F), jnp.int32)), TypeError,
     r"lhs must be a floating-point array"),
    # Mixed float dtypes are accepted (as by jax.lax.ragged_dot); integer weights are not.
    ("integer_rhs", dict(rhs=jnp.ones((E, D, F), jnp.int8)), TypeError, r"rhs must be a floating-point array"),
    ("bad_impl", dict(impl="cutlass"), ValueError, r"impl must be one of"),
]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("name,kwargs,exc,match", GMM_BAD, ids=[c[0] for c in GMM_BAD])
def test_grouped_matmul_rejects(name, kwargs, exc, match, traced):
  a = dict(lhs=jnp.ones((T, D), f32), rhs=jnp.ones((E, D, F), f32),
           group_sizes=jnp.asarray([1, 2, 0, 3], jnp.int32), impl="reference")
  a.update(kwargs)
  impl = a.pop("impl")
  f = lambda a: sj.grouped_matmul(a["lhs"], a["rhs"], a["group_sizes"], impl=impl)
  with pytest.raises(exc, match=match):
    jax.eval_shape(f, a) if traced else f(a)
  if name == "bad_impl":
    return
  # The base call is valid.
  assert sj.grouped_matmul(jnp.ones((T, D)), jnp.ones((E, D, F)), jnp.asarray([1, 2, 0, 3])).shape == (T, F)


LOGITS = jnp.zeros((T, E), f32)
ROUTING_BAD = [
    ("topk_k_gt_E", lambda: sj.top_k_routing(LOGITS, E + 1), ValueError, r"k=5 exceeds the number of experts"),
    ("topk_k_zero", lambda: sj.top_k_routing(LOGITS, 0), ValueError, r"k must be >= 1"),
    ("topk_k_float", lambda: sj.top_k_routing(LOGITS, 2.0), TypeError, r"k must be a Python int"),
    ("topk_rank", lambda: sj.top_k_routing(jnp.zeros((2, T, E)), 1), ValueError, r"logits must have rank 2"),
    ("topk_int_logits", lambda: sj.top_k_routing(jnp.zeros((T, E), jnp.int32), 1), TypeError,
     r"logits must be a floating-point array"),
    ("ec_cf_zero", lambda: sj.expert_choice_routing(LOGITS, 0.0), ValueError, r"capacity_factor must be > 0"),
    ("ec_cf_negative", lambda: sj.expert_choice_routing(LOGITS, -0.5), ValueError, r"capacity_factor must be > 0"),
    ("capacity_cf_zero", lambda: sj.capacity(T, E, 1, 0), ValueError, r"capacity_factor must be > 0"),
    ("dts_threshold", lambda: sj.dense_to_sparse_routing(LOGITS, 1.0, 1.5), ValueError, r"threshold must lie in"),
    ("dts_temperature", lambda: sj.dense_to_sparse_routing(LOGITS, 0.0, 0.1), ValueError, r"temperature must be > 0"),
    ("dts_max_k", lambda: sj.dense_to_sparse_routing(LOGITS, 1.0, 0.1, max_k=E + 1), ValueError, r"exceeds"),
    ("schedule", lambda: sj.dts_temperature_schedule(0.0, 0.1, 10), ValueError, r"init_temperature must be > 0"),
    ("router_d_model", lambda: sj.router_logits(jnp.ones((T, D)), jnp.ones((D + 1, E))), ValueError,
     r"x has d_model=8 but w_router expects 9"),
    ("router_jitter", lambda: sj.router_logits(jnp.ones((T, D)), jnp.ones((D, E)), jitter_eps=-0.1), ValueError,
     r"jitter_eps must be >= 0"),
    ("router_int_x", lambda: sj.router_logits(jnp.ones((T, D), jnp.int32), jnp.ones((D, E))), TypeError,
     r"x must be a floating-point array"),
    ("lb_tokens", lambda: sj.load_balancing_loss(jnp.ones((T, E)) / E, jnp.zeros((T + 1, 1), jnp.int32)),
     ValueError, r"expert_ids has 7 tokens but router_probs has 6"),
    ("lb_float_ids", lambda: sj.load_balancing_loss(jnp.ones((T, E)) / E, jnp.zeros((T, 1))), TypeError,
     r"expert_ids must be an integer array"),
    ("z_rank", lambda: sj.router_z_loss(jnp.ones((E,))), ValueError, r"logits must have rank 2"),
    # A mean over no tokens is NaN: an empty batch is refused, not turned into a NaN loss.
    ("lb_no_tokens", lambda: sj.load_balancing_loss(jnp.ones((0, E)), jnp.zeros((0, 1), jnp.int32)), ValueError,
     r"router_probs has no tokens"),
    ("z_no_tokens", lambda: sj.router_z_loss(jnp.ones((0, E))), ValueError, r"logits has no tokens"),
    ("ec_mlp_no_tokens", lambda: sj.expert_choice_mlp(
        jnp.ones((0, D)), sj.expert_choice_routing(LOGITS, 1.0), jnp.ones((E, D, F)), jnp.ones((E, F, D))),
     ValueError, r"x has no tokens"),
    ("ec_mlp_experts", lambda: sj.expert_choice_mlp(
        jnp.ones((T, D)), sj.expert_choice_routing(LOGITS, 1.0), jnp.ones((E + 1, D, F)), jnp.ones((E + 1, F, D))),
     ValueError, r"routing has 4 experts but w_in has 5"),
]


@pytest.mark.parametrize("name,fn,exc,match", ROUTING_BAD, ids=[c[0] for c in ROUTING_BAD])
def test_routing_and_losses_reject(name, fn, exc, match):
  with pytest.raises(exc, match=match):
    fn()


CONFIG_BAD = [
    (dict(d_model=0), r"MoEConfig.d_model must be a positive int"),
    (dict(d_ff=-1), r"MoEConfig.d_ff must be a positive int"),
    (dict(num_experts=0), r"MoEConfig.num_experts must be a positive int"),
    (dict(router="hash"), r"MoEConfig.router must be one of"),
    (dict(activation="tanh"), r"MoEConfig.activation must be one of"),
    (dict(top_k=9), r"MoEConfig.top_k must lie in \[1, num_experts=8\]"),
    (dict(top_k=0), r"MoEConfig.top_k must lie in"),
    (dict(capacity_factor=0.0), r"MoEConfig.capacity_factor must be > 0"),
    (dict(router="expert_choice"), r"router='expert_choice' needs a capacity_factor"),
    (dict(top_k=1.5), r"MoEConfig.top_k must be an int"),
    (dict(impl="cuda"), r"MoEConfig.impl must be one of"),
    (dict(impl="cuda", router="expert_choice", capacity_factor=1.0), r"MoEConfig.impl must be one of"),
    (dict(jitter_eps=-0.1), r"MoEConfig.jitter_eps must be >= 0"),
    (dict(glu="False"), r"MoEConfig.glu must be True or False; got 'False'"),  # a truthy string would turn GLU on
    (dict(renormalize="no"), r"MoEConfig.renormalize must be True or False or None"),
    (dict(dtype="foo"), r"MoEConfig.dtype must be a floating dtype"),
    (dict(param_dtype=jnp.int32), r"MoEConfig.param_dtype must be a floating dtype"),
    (dict(load_balancing_weight=-1.0), r"MoEConfig.load_balancing_weight must be >= 0"),
    (dict(z_loss_weight="1e-3"), r"MoEConfig.z_loss_weight must be a number"),
    (dict(capacity_factor="1.25"), r"MoEConfig.capacity_factor must be a number or None"),
    (dict(router="dense_to_sparse", dts_threshold=1.0), r"MoEConfig.dts_threshold must lie in \[0, 1\)"),
    (dict(router="dense_to_sparse", dts_max_k=9), r"MoEConfig.dts_max_k must lie in \[1, num_experts=8\]"),
]


@pytest.mark.parametrize("kwargs,match", CONFIG_BAD, ids=[str(c[0]) for c in CONFIG_BAD])
def test_bad_moe_config(kwargs, match):
  base = dict(d_model=8, d_ff=16)
  sj.MoEConfig(**base)  # valid without the change
  with pytest.raises(ValueError, match=match):
    sj.MoEConfig(**{**base, **kwargs})


def _one_line(exc_type, match, fn):
  with pytest.raises(exc_type, match=match) as e:
    fn()
  assert "\n" not in str(e.value)


def test_entry_points_name_a_wrong_kind_of_argument():
  """What a newcomer passes by mistake: a mesh that is not one, a routing of the other kind, sizes that do not fit."""
  from sparsejax import mesh as meshlib
  a = _ok()
  x, ids, cw, w_in, w_out = (a[n] for n in ("x", "expert_ids", "combine_weights", "w_in", "w_out"))
  logits = jnp.ones((T, E), f32)
  tc, ec = sj.top_k_routing(logits, K), sj.expert_choice_routing(logits, 1.0)
  _one_line(ValueError, r"make_expert_mesh: data must be a positive int; got 0", lambda: meshlib.make_expert_mesh(0, 4))
  from flax import nnx
  _one_line(TypeError, r"mesh must be a jax.sharding.Mesh.*got str",  # when built, not at the first call
            lambda: sj.MoE(sj.MoEConfig(d_model=D, d_ff=F, num_experts=E), rngs=nnx.Rngs(0), mesh="expert"))
  _one_line(TypeError, r"mesh must be a jax.sharding.Mesh.*got NoneType",
            lambda: sj.expert_parallel_moe_mlp(x, ids, cw, w_in, w_out, mesh=None))
  _one_line(TypeError, r"mesh must be a jax.sharding.Mesh.*got str",
            lambda: sj.rounded_moe_mlp(x, tc, w_in, w_out, mesh="expert"))
  _one_line(TypeError, r"routing must be a TokenChoiceRouting.*got tuple",
            lambda: sj.rounded_moe_mlp(x, (ids, cw), w_in, w_out))
  _one_line(TypeError, r"routing must be a TokenChoiceRouting.*got ExpertChoiceRouting", lambda: sj.round_to_blocks(ec))
  _one_line(TypeError, r"routing must be an ExpertChoiceRouting.*got TokenChoiceRouting",
            lambda: sj.expert_choice_mlp(x, tc, w_in, w_out))
  _one_line(TypeError, r"activation must be a function", lambda: sj.expert_ffn(x, None, w_in[:1], w_out[:1],
                                                                               activation="gelu"))
  lhs, rhs = jnp.ones((8, D), f32), jnp.ones((2, D, F), f32)
  _one_line(ValueError, r"group_sizes sum to 12, more than lhs's 8 rows",
            lambda: sj.grouped_matmul(lhs, rhs, jnp.array([6, 6])))
  _one_line(ValueError, r"group_sizes must be >= 0", lambda: sj.grouped_matmul(lhs, rhs, jnp.array([-2, 10])))
  sj.grouped_matmul(lhs, rhs, jnp.array([3, 5]))  # the fitting call still runs


def test_dir_lists_the_api_not_the_packages_own_imports():
  names = dir(sj)
  assert "moe_mlp" in names and "rounded_moe_mlp" in names
  assert not {"sys", "importlib", "types", "annotations", "TYPE_CHECKING"} & set(names)
