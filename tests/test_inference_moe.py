"""The small-batch MoE path and int8 experts: equal to moe_mlp, and clear errors on bad input."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import NO_EXPERT, moe_mlp
from sparsejax.inference import decode_moe_mlp, dequantize, quantize_experts, quantize_weight
from sparsejax.kernels.group_rows import row_groups
from tests.moe_testing import seed_of

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _case(tokens, experts, k, d=16, f=24, dtype=jnp.float32, glu=False, seed=0, ids=None):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((tokens, d)).astype(np.float32)
  if ids is None:  # k distinct experts per token
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)])
  cw = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
  w = {n: (rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)
       for n, s in (("w_in", (experts, d, f)), ("w_out", (experts, f, d)), ("w_gate", (experts, d, f)))}
  if not glu:
    del w["w_gate"]
  cast = lambda a: jax.device_put(np.asarray(a).astype(dtype))  # cast and moved with no small program per shape
  return cast(x), jnp.asarray(ids, jnp.int32), cast(cw), {n: cast(v) for n, v in w.items()}


@functools.partial(jax.jit, static_argnames="act")
def _moe_mlp_and_stats(x, ids, cw, w, act=jax.nn.gelu):
  """moe_mlp's (y, stats): the reference, one jitted program (op by op, each shape compiled dozens)."""
  return moe_mlp(x, ids, cw, w["w_in"], w["w_out"], w_gate=w.get("w_gate"), activation=act)


def _moe_mlp(x, ids, cw, w, act=jax.nn.gelu):
  return _moe_mlp_and_stats(x, ids, cw, w, act=act)[0]


def _decode(x, ids, cw, w, act=jax.nn.gelu):
  return decode_moe_mlp(x, ids, cw, w["w_in"], w["w_out"], w_gate=w.get("w_gate"), activation=act)[0]


CASES = {  # name: (tokens, experts, k, glu, ids)
    "top1": (5, 8, 1, False, None),
    "top2_glu": (6, 8, 2, True, None),
    "one_expert": (4, 1, 1, False, None),
    "k_equals_E": (3, 4, 4, False, None),
    "more_assignments_than_experts": (7, 3, 2, True, None),
    "repeated_experts": (6, 8, 2, False, np.array([[3, 5], [5, 3], [3, 1], [5, 7], [3, 5], [1, 3]])),
    "no_expert_slots": (4, 6, 2, False, np.array([[2, NO_EXPERT], [NO_EXPERT, NO_EXPERT], [4, 2], [0, 5]])),
    "one_token": (1, 64, 1, False, None),
    "one_token_top3_glu": (1, 8, 3, True, None),
    "one_token_no_expert": (1, 4, 2, False, np.array([[NO_EXPERT, 2]])),
    # Above ROW_GROUP (16) tokens each expert takes its own tokens in groups of 16 rows (_grouped_rows_ffn).
    "grouped_top2_glu": (24, 8, 2, True, None),
    "grouped_all_on_one_expert": (20, 4, 1, False, np.zeros((20, 1), np.int32)),
    "grouped_k_equals_E": (17, 3, 3, False, None),  # 17 tokens an expert: two groups each, the bound exactly
    "grouped_one_expert": (33, 1, 1, False, None),  # three groups of one expert
    "grouped_no_expert": (18, 6, 2, False, np.where(np.arange(36).reshape(18, 2) % 5 == 0, NO_EXPERT,
                                                     np.arange(36).reshape(18, 2) % 6)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_equals_moe_mlp(name, dtype):
  t, e, k, glu, ids = CASES[name]
  x, ids, cw, w = _case(t, e, k, dtype=dtype, glu=glu, ids=ids, seed=seed_of(name, str(dtype)))
  both = lambda f: jax.jit(lambda x, cw, w: f(x, ids, cw, w["w_in"], w["w_out"], w_gate=w.get("w_gate")))
  want, ref_stats = both(moe_mlp)(x, cw, w)
  got, stats = both(decode_moe_mlp)(x, cw, w)
  assert got.dtype == x.dtype and got.shape == x.shape
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOL[dtype])
  np.testing.assert_array_equal(stats.tokens_per_expert, ref_stats.tokens_per_expert)
  assert int(stats.num_dropped) == 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("grouped")])
def test_grouped_rows_placed_by_the_kernel(name, dtype, monkeypatch):
  """The grouped cases with the groups placed by kernels.group_rows' Pallas kernel (interpret mode here), as a
  GPU places them: equal to moe_mlp, and to the XLA placement exactly."""
  from sparsejax.inference import decode_moe
  t, e, k, glu, ids = CASES[name]
  x, ids, cw, w = _case(t, e, k, dtype=dtype, glu=glu, ids=ids, seed=seed_of("placed", name, str(dtype)))
  run = lambda: jax.jit(lambda x, cw, w: decode_moe_mlp(x, ids, cw, w["w_in"], w["w_out"],
                                                        w_gate=w.get("w_gate")))(x, cw, w)
  monkeypatch.setattr(decode_moe, "GROUP_ROWS_IMPL", "xla")
  xla, xla_stats = run()
  monkeypatch.setattr(decode_moe, "GROUP_ROWS_IMPL", "triton")
  got, stats = run()
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(xla, np.float32))
  # the layer's tokens_per_expert, the kernel's own counts: moe_mlp's
  np.testing.assert_array_equal(stats.tokens_per_expert, xla_stats.tokens_per_expert)
  want, want_stats = _moe_mlp_and_stats(x, ids, cw, w)
  np.testing.assert_array_equal(stats.tokens_per_expert, want_stats.tokens_per_expert)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOL[dtype])


def test_padding_slots_hold_no_expert(monkeypatch):
  """The static min(T k, E) slots hold each distinct chosen expert once and pad with E (no expert, which
  the kernels neither read nor compute), not with a repeat of an expert: a repeat ran its FFN again."""
  from sparsejax.inference import decode_moe
  seen = []
  real = decode_moe.skinny_ffn
  monkeypatch.setattr(decode_moe, "skinny_ffn", lambda *a, experts, **kw: seen.append(experts) or real(
      *a, experts=experts, **kw))
  x, _, cw, w = _case(6, 8, 1, seed=3)
  ids = jnp.asarray([[1], [5], [1], [NO_EXPERT], [5], [1]], jnp.int32)
  got = _decode(x, ids, cw, w)
  np.testing.assert_array_equal(np.asarray(seen[-1]), [1, 5, 8, 8, 8, 8])
  np.testing.assert_allclose(np.asarray(got), np.asarray(_moe_mlp(x, ids, cw, w)), **TOL[jnp.float32])


def test_grouped_rows_give_each_expert_its_own_tokens(monkeypatch):
  """Above ROW_GROUP tokens skinny_ffn gets [groups, 16, d]: expert e's tokens in ceil(c_e / 16) groups, in
  expert order, the unfilled groups' expert E (nothing read); the result equals the every-token-through-every-
  expert form (COMPACT_ROWS off) and moe_mlp."""
  from sparsejax.inference import decode_moe
  seen = []
  real = decode_moe.skinny_ffn
  monkeypatch.setattr(decode_moe, "skinny_ffn", lambda x, *a, experts, **kw: seen.append((x, experts)) or real(
      x, *a, experts=experts, **kw))
  x, _, cw, w = _case(20, 8, 1, seed=4)
  ids = jnp.asarray([[5]] * 17 + [[1], [NO_EXPERT], [1]], jnp.int32)
  got = _decode(x, ids, cw, w)
  xs, experts = seen[-1]
  assert xs.shape == (row_groups(20, 8, decode_moe.ROW_GROUP), 16, 16)
  np.testing.assert_array_equal(np.asarray(experts), [1, 5, 5] + [8] * (xs.shape[0] - 3))
  xs, x_np = np.asarray(xs), np.asarray(x)  # indexed on the host
  np.testing.assert_array_equal(xs[0, :2], x_np[[17, 19]])  # expert 1's tokens
  np.testing.assert_array_equal(xs[2, 0], x_np[16])  # expert 5's 17th token opens its 2nd group
  assert not np.any(xs[0, 2:]) and not np.any(xs[2, 1:])
  np.testing.assert_allclose(np.asarray(got), np.asarray(_moe_mlp(x, ids, cw, w)), **TOL[jnp.float32])
  monkeypatch.setattr(decode_moe, "COMPACT_ROWS", False)
  shared = jax.jit(lambda x, cw: _decode(x, ids, cw, w))(x, cw)  # traced afresh, under the flag
  np.testing.assert_allclose(np.asarray(shared), np.asarray(got), **TOL[jnp.float32])
  assert seen[-1][0].shape == x.shape  # the shared-x form


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_grouped_rows_at_shapes_the_kernels_take(dtype, int8):
  """d and f multiples of 16, so on a GPU skinny_matmul's kernels run the groups (CASES' f 24 takes the
  reference there): 24 tokens, top-2 of 4 experts, expert 0 chosen by 20 tokens (two groups)."""
  x, _, cw, w = _case(24, 4, 2, d=64, f=128, glu=True, seed=7)
  ids = jnp.asarray(np.stack([np.zeros(24, int), 1 + np.arange(24) % 3], 1)).at[20:, 0].set(3)
  x, cw = x.astype(dtype), cw.astype(dtype)
  if int8:
    qs = {n: quantize_weight(v) for n, v in w.items()}
    w = {n: dequantize(q, s, dtype) for n, (q, s) in qs.items()}
    got = jax.jit(lambda x, cw, q, s: decode_moe_mlp(
        x, ids, cw, q["w_in"], q["w_out"], w_gate=q["w_gate"], w_in_scale=s["w_in"], w_out_scale=s["w_out"],
        w_gate_scale=s["w_gate"])[0])(x, cw, {n: v[0] for n, v in qs.items()}, {n: v[1] for n, v in qs.items()})
  else:
    w = {n: v.astype(dtype) for n, v in w.items()}
    got = jax.jit(lambda x, cw, w: _decode(x, ids, cw, w))(x, cw, w)
  want = _moe_mlp(x, ids, cw, w)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOL[dtype])


@pytest.mark.parametrize("tokens", [4, 20])
def test_gradients_match_moe_mlp(tokens):
  x, ids, cw, w = _case(tokens, 8, 2, glu=True, seed=1)
  loss = lambda f: lambda x, cw, w: jnp.sum(jnp.sin(f(x, ids, cw, w)))
  want = jax.jit(jax.grad(loss(_moe_mlp), argnums=(0, 1, 2)))(x, cw, w)
  got = jax.jit(jax.grad(loss(_decode), argnums=(0, 1, 2)))(x, cw, w)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_quantize_weight_bounds_the_error_by_half_a_step():
  w = jnp.asarray(np.random.default_rng(2).standard_normal((3, 16, 8)), jnp.float32).at[1, :, 2].set(0.0)
  q, s = quantize_weight(w)
  assert q.dtype == jnp.int8 and s.shape == (3, 8) and s.dtype == jnp.float32
  assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) == 127  # absmax maps to the edge
  err = jnp.abs(dequantize(q, s, jnp.float32) - w)
  assert bool(jnp.all(err <= s[:, None, :] / 2 + 1e-7))
  assert q.shape == (3, 8, 16)  # k-major: each output channel's 16 inputs contiguous
  assert bool(jnp.all(q[1, 2, :] == 0)) and float(s[1, 2]) == 1.0  # an all-zero column stays zero


@pytest.mark.parametrize("tokens", [6, 24])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_int8_equals_dequantize_then_moe_mlp(dtype, tokens):
  x, ids, cw, w = _case(tokens, 8, 2, glu=True, dtype=jnp.float32, seed=seed_of("int8", str(dtype)))
  qs = {n: quantize_weight(v) for n, v in w.items()}
  deq = {n: dequantize(q, s, dtype) for n, (q, s) in qs.items()}
  x, cw = x.astype(dtype), cw.astype(dtype)
  want = jax.jit(_moe_mlp)(x, ids, cw, deq)
  got = jax.jit(lambda x, cw, q, s: decode_moe_mlp(
      x, ids, cw, q["w_in"], q["w_out"], w_gate=q["w_gate"], w_in_scale=s["w_in"], w_out_scale=s["w_out"],
      w_gate_scale=s["w_gate"])[0])(x, cw, {n: v[0] for n, v in qs.items()}, {n: v[1] for n, v in qs.items()})
  # Same math, scales applied after the product instead of before it: only rounding differs.
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOL[dtype])
  # And int8 stays close to the float layer: per-channel absmax leaves ~1% of the output's scale.
  full = np.asarray(_moe_mlp(x, ids, cw, {n: v.astype(dtype) for n, v in w.items()}), np.float32)
  rel = np.linalg.norm(np.asarray(got, np.float32) - full) / np.linalg.norm(full)
  assert rel < 0.03, rel


def test_quantize_experts_on_a_params_dict():
  rng = np.random.default_rng(3)
  moe = {"router": {"w": jnp.ones((4, 2))}, "w_in": jnp.asarray(rng.standard_normal((2, 4, 6)), jnp.float32),
         "w_out": jnp.asarray(rng.standard_normal((2, 6, 4)), jnp.float32)}
  params = {"blocks": {0: {"ffn": moe, "attn": {"w_qkv": jnp.ones((4, 3, 1, 4))}}}, "embed": jnp.ones((8, 4))}
  q = quantize_experts(params)
  ffn = q["blocks"][0]["ffn"]
  assert ffn["w_in"].dtype == jnp.int8 and ffn["w_out"].dtype == jnp.int8
  assert ffn["w_in_scale"].shape == (2, 6) and ffn["w_out_scale"].shape == (2, 4)
  assert q["embed"] is params["embed"] and q["blocks"][0]["attn"]["w_qkv"] is params["blocks"][0]["attn"]["w_qkv"]
  assert params["blocks"][0]["ffn"]["w_in"].dtype == jnp.float32  # the input is not modified
  with pytest.raises(ValueError, match="already quantized"):
    quantize_experts(q)
  with pytest.raises(TypeError, match="pure params dict"):
    quantize_experts([1, 2])
  # No MoE layer (a dense model, or the wrong subtree): an error, not the params back unquantized.
  for no_moe in ({"embed": jnp.ones((8, 4))}, {"w_in": jnp.ones((3,))}, params["blocks"][0]["attn"]):
    with pytest.raises(ValueError, match="no MoE layer"):
      quantize_experts(no_moe)


def test_bad_inputs_fail_with_clear_errors():
  x, ids, cw, w = _case(4, 4, 1, seed=4)
  q, s = quantize_weight(w["w_in"])
  qo, so = quantize_weight(w["w_out"])
  call = lambda **kw: decode_moe_mlp(**{"x": x, "expert_ids": ids, "combine_weights": cw,
                                        "w_in": w["w_in"], "w_out": w["w_out"], **kw})
  with pytest.raises(ValueError, match="x must have rank 2"):
    call(x=x[None])
  with pytest.raises(ValueError, match="x has d_model=8"):
    call(x=x[:, :8])
  with pytest.raises(ValueError, match=r"must both be \[tokens=4, k\]"):
    call(expert_ids=ids[:3], combine_weights=cw[:3])
  with pytest.raises(ValueError, match=r"x has no tokens"):  # was "attempt to get argmax of an empty sequence"
    call(x=x[:0], expert_ids=ids[:0], combine_weights=cw[:0])
  with pytest.raises(TypeError, match="expert_ids must be an integer"):
    call(expert_ids=ids.astype(jnp.float32))
  with pytest.raises(ValueError, match="w_out must be"):
    call(w_out=w["w_out"][:, :5])
  with pytest.raises(TypeError, match="w_in must be int8 when scales are given"):
    call(w_in_scale=s, w_out=qo, w_out_scale=so)
  with pytest.raises(ValueError, match="w_out is int8 but w_out_scale is missing"):
    call(w_in=q, w_in_scale=s, w_out=qo)
  with pytest.raises(ValueError, match=r"but w_in is .* \(int8: k-major, as quantize_weight stores it\)"):
    call(w_in=jnp.swapaxes(q, 1, 2), w_in_scale=s, w_out=qo, w_out_scale=so)  # int8 laid out as a float weight
  with pytest.raises(ValueError, match=r"w_in_scale must be \[experts, out channels\]"):
    call(w_in=q, w_in_scale=s[:, :3], w_out=qo, w_out_scale=so)
  with pytest.raises(TypeError, match="w_in_scale must be a floating"):
    call(w_in=q, w_in_scale=s.astype(jnp.int32), w_out=qo, w_out_scale=so)
  with pytest.raises(TypeError, match="w_in must be a floating"):
    call(w_in=w["w_in"].astype(jnp.int32))
  with pytest.raises(TypeError, match="only floating expert weights"):
    quantize_weight(q)
  with pytest.raises(ValueError, match=r"\[experts, n_in, n_out\]"):
    quantize_weight(w["w_in"][0])
