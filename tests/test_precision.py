"""Float32 inputs give float32 answers on every backend: the dots of the library's float32 programs ask
for HIGHEST (the router's for six bf16 passes, as accurate), and its bf16 programs keep their dots'
precision unset, as they always had.

A GPU runs a default-precision float32 dot as TF32 (10-bit mantissas), which the CPU cannot show in the
numbers, so these tests read the precision each dot asks for in the traced program, forward and backward,
nested jaxprs (jit, custom_vjp, scan, cond, Pallas kernel bodies) included. Nothing is compiled.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sparsejax as sj
from moe_testing import dot_precisions, is_highest, rand, seed_of
from sparsejax._precision import dot_precision, full_precision
from sparsejax.inference import decode_moe_mlp
from sparsejax.kernels.decode_attention import decode_attention
from sparsejax.models import Transformer, TransformerConfig
from sparsejax.models.transformer import attention_impl

D, F, E = 16, 32, 4
HALF = ("bfloat16", "float16")


def assert_float32_dots_highest(found, at_least):
  """Every dot of two float32 operands asks for float32 accuracy (moe_testing.is_highest); at_least of
  them, so the check is not empty."""
  f32 = [(name, p) for name, p, dtypes in found if dtypes == ("float32", "float32")]
  assert len(f32) >= at_least, found
  assert all(is_highest(p) for _, p in f32), [f for f in found if not is_highest(f[1])]


def assert_half_dots_unset(found, at_least):
  """Every dot with a half-precision operand leaves precision unset (the backend default), as before the
  float32 fix. jax.nn.dot_product_attention sets an algorithm preset on its bf16 logits itself: that one
  is jax's choice, never HIGHEST."""
  half = [(name, p) for name, p, dtypes in found if set(dtypes) & set(HALF)]
  assert len(half) >= at_least, found
  assert all(p is None or isinstance(p, jax.lax.DotAlgorithmPreset) for _, p in half), half


def test_dot_precision_is_highest_for_float32_only():
  hi = jax.lax.Precision.HIGHEST
  assert dot_precision(jnp.float32) == hi and dot_precision(jnp.ones(2)) == hi
  assert dot_precision(jnp.bfloat16, jnp.float32) == hi  # mixed inputs compute in float32
  assert dot_precision(jnp.bfloat16) is None and dot_precision(jnp.float16) is None
  assert full_precision(None, jnp.bfloat16) is None
  default = jax.lax.Precision.DEFAULT
  assert full_precision(default, jnp.float32) == default  # an explicit choice wins
  assert full_precision([default, hi], jnp.float32) == (default, hi)


def _grad_dots(module, x):
  """Dots of d/d(params, x) sum(module(x)[0]): the forward and both transposes of every product."""
  graph, state = nnx.split(module)

  def loss(state, x):
    y, stats = nnx.merge(graph, state)(x)
    return jnp.sum(y.astype(jnp.float32)) + stats.aux_loss

  return dot_precisions(jax.grad(loss, argnums=(0, 1)), state, x)


LAYERS = {  # name: (MoEConfig fields or None for the dense MLP, products forward)
    "dropless": (dict(top_k=2, impl="ragged_dot"), 3),  # router, w_in, w_out
    "dropless_triton": (dict(top_k=2, impl="triton"), 2),  # router; the expert MLP in Pallas kernels
    "capacity_glu": (dict(top_k=2, capacity_factor=1.0, glu=True), 4),
    "expert_choice": (dict(router="expert_choice", capacity_factor=1.0), 3),
    "dense_mlp_glu": (None, 3),
}


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layers(name, dtype):
  fields, products = LAYERS[name]
  dt = jnp.dtype(dtype)
  if fields is None:
    module = sj.MLP(sj.MoEConfig(d_model=D, d_ff=F, glu=True, dtype=dt), rngs=nnx.Rngs(0))
  else:
    module = sj.MoE(sj.MoEConfig(d_model=D, d_ff=F, num_experts=E, dtype=dt, **fields), rngs=nnx.Rngs(0))
  x = jnp.asarray(rand(np.random.default_rng(seed_of("precision", name)), (12, D)), dt)
  found = _grad_dots(module, x)
  if dtype == "float32":
    assert_float32_dots_highest(found, 3 * products)
  else:  # the router's float32 product keeps float32 accuracy (routing.py); the expert products stay unset
    assert_half_dots_unset(found, 3 * (products - (fields is not None)))


MODELS = {
    "dense": dict(moe_every=0),
    "moe_dropless": dict(moe_every=1),
    "moe_capacity_glu": dict(moe_every=1, capacity_factor=1.0, glu=True),
}


def _model(dtype, **fields):
  cfg = TransformerConfig(d_model=D, num_layers=1, num_heads=2, d_ff=F, num_experts=E, top_k=2,
                          max_seq_len=48, dtype=dtype, moe_impl="ragged_dot", **fields)
  return Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformer_forward_and_backward(name, dtype):
  """Attention projections, q k^T and p v (inside jax.nn.dot_product_attention), the FFN and the head."""
  model = _model(dtype, **MODELS[name])
  graph, state = nnx.split(model)
  tokens = jnp.asarray(np.arange(16).reshape(2, 8) % 256, jnp.int32)

  def loss(state):
    logits, stats = nnx.merge(graph, state)(tokens)
    return jnp.mean(logits) + stats.aux_loss

  found = dot_precisions(jax.grad(loss), state)
  if dtype == "float32":
    assert_float32_dots_highest(found, 3 * 7)
  else:  # on a GPU bf16 attention is cuDNN's fused kernel (attention_impl), whose q k^T and p v are no dots
    assert_half_dots_unset(found, 3 * (5 if attention_impl(model.cfg) == "cudnn" else 6))


@pytest.mark.parametrize("moe_every", [0, 1], ids=["dense", "moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoding(moe_every, dtype):
  """Prefill of more rows than skinny_matmul takes (XLA products, masked attention, moe_mlp), a prefill
  of few rows, and a one-token step (skinny_matmul, decode_attention, decode_moe_mlp)."""
  model = _model(dtype, moe_every=moe_every)
  model.init_cache(2, 48)
  graph, state = nnx.split(model)
  step = lambda state, tokens: nnx.merge(graph, state)(tokens, decode=True)[0]
  for t in (40, 8, 1):
    found = dot_precisions(step, state, jnp.zeros((2, t), jnp.int32))
    if dtype == "float32":
      assert_float32_dots_highest(found, 7)
    else:  # less q k^T and p v, float32 in decode_attention's reference
      assert_half_dots_unset(found, 5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_attention_kernel_merge(dtype):
  """Two splits' float32 partials are merged by a dot: HIGHEST for a float32 q, unset for bf16 (the
  kernel body itself has no dot); a cache of one chunk is one split, normalized in the kernel, with no dot."""
  dt = jnp.dtype(dtype)
  q, cache = jnp.ones((2, 2, 16), dt), jnp.ones((2, 128, 2, 16), dt)  # two 64-slot chunks, so two splits
  start, index = jnp.zeros((2,), jnp.int32), jnp.int32(100)
  found = dot_precisions(lambda q: decode_attention(q, cache, cache, start, index, impl="triton"), q)
  assert len(found) == 1 and found[0][2] == ("float32", "float32"), found
  assert is_highest(found[0][1]) if dtype == "float32" else found[0][1] is None
  assert dot_precisions(lambda q: decode_attention(q, cache[:, :32], cache[:, :32], start, 20, impl="triton"), q) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_moe_mlp(dtype):
  """The small-batch layer: its expert products (skinny_matmul) and its two float32 combine products."""
  dt = jnp.dtype(dtype)
  rng = np.random.default_rng(seed_of("precision_decode_moe"))
  x = jnp.asarray(rand(rng, (3, D)), dt)
  ids = jnp.asarray([[0, 1], [2, 1], [3, 0]], jnp.int32)
  cw = jnp.full((3, 2), 0.5, jnp.float32)
  w_in, w_out = jnp.asarray(rand(rng, (E, D, F)), dt), jnp.asarray(rand(rng, (E, F, D)), dt)
  found = dot_precisions(lambda x: decode_moe_mlp(x, ids, cw, w_in, w_out)[0], x)
  assert len(found) == 4, found  # w_in, w_out and the two combine products
  if dtype == "float32":
    assert_float32_dots_highest(found, 4)
  else:
    assert all(p is None for _, p, _ in found), found


@pytest.mark.parametrize("cc,passes", [("7.5", False), ("7.0", False), ("8.0", True), ("9.0", True)])
def test_before_sm80_the_router_asks_for_highest_and_attention_leaves_cudnn(monkeypatch, cc, passes):
  """XLA:GPU refuses the six-bf16-pass algorithm before sm_80 (no bf16 tensor cores: T4, V100) and cuDNN's flash
  attention needs sm_80 too, so on such a GPU the router's three float32 dots ask for HIGHEST (exact there: no TF32
  either) and "auto" attention runs XLA's. The GPU's generation is set, the program traced on the CPU."""
  import sparsejax.kernels
  monkeypatch.setattr(sparsejax.kernels, "gpu_compute_capability", lambda: cc)
  rng = np.random.default_rng(seed_of("router_before_sm80", cc))
  x, w, g = (jnp.asarray(rand(rng, s)) for s in [(8, D), (D, E), (8, E)])
  loss = lambda x, w: jnp.sum(sj.router_logits(x, w) * g)
  found = [str(p) for _, p, _ in dot_precisions(jax.grad(loss, argnums=(0, 1)), x, w)]
  want = str(jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6 if passes else (jax.lax.Precision.HIGHEST,) * 2)
  assert found == [want] * 3, found
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  np.testing.assert_allclose(np.asarray(sj.router_logits(x, w)), exact, rtol=1e-5, atol=1e-6)
  cfg = TransformerConfig(vocab_size=16, d_model=D, num_heads=2, num_layers=1, d_ff=F, dtype="bfloat16")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert attention_impl(cfg) == ("cudnn" if passes else None)
