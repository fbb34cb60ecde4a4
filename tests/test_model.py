"""The Transformer LM: shapes, dtypes, gradients, router stats, and clear config errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_testing import jaxpr_equations, loss_grads_and_kept_bytes
from sparsejax.models import PRESETS, Transformer, TransformerConfig, cross_entropy, get_preset
from sparsejax.models.transformer import rotary

SMALL = TransformerConfig(d_model=32, num_layers=2, num_heads=4, d_ff=64, moe_every=2, num_experts=4,
                          max_seq_len=64)


@pytest.mark.parametrize("dtype,moe_every", [("float32", 0), ("float32", 2), ("bfloat16", 1)])
def test_forward_backward_shapes_and_dtypes(dtype, moe_every):
  cfg = SMALL.replace(dtype=dtype, moe_every=moe_every)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
  # Jitted: op-by-op dispatch of the MoE layers costs more than compiling them once.
  logits, stats = nnx.jit(lambda m, t, r: m(t, rng=r))(model, tokens, jax.random.key(2))
  assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
  assert stats.tokens_per_expert.shape == (cfg.num_moe_layers, 4)
  assert stats.dropped_fraction.shape == (cfg.num_moe_layers,)
  if cfg.num_moe_layers:
    # Dropless top-1: every token reaches exactly one expert in each MoE layer.
    np.testing.assert_array_equal(stats.tokens_per_expert.sum(-1), 32)
    assert float(stats.aux_loss) > 0
  else:
    assert float(stats.aux_loss) == 0

  def loss(model):
    logits, stats = model(tokens)
    return cross_entropy(logits, jnp.roll(tokens, -1, 1)) + stats.aux_loss

  grads = nnx.jit(nnx.grad(loss))(model)
  for p, g in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(grads)):
    assert g.shape == p.shape and g.dtype == jnp.float32  # float32 params whatever the compute dtype
    assert bool(jnp.all(jnp.isfinite(g)))


def test_causal():
  """Changing a later token leaves earlier logits unchanged."""
  model = Transformer(SMALL.replace(moe_every=0), rngs=nnx.Rngs(0))
  a = jnp.arange(16)[None] % 256
  b = a.at[0, 10].set(99)
  forward = nnx.jit(lambda m, t: m(t)[0])  # one program (op by op, the layers compiled dozens of small ones)
  la, lb = forward(model, a), forward(model, b)
  np.testing.assert_allclose(la[:, :10], lb[:, :10], rtol=1e-5, atol=1e-5)
  assert not np.allclose(la[:, 10:], lb[:, 10:])


def test_rotary_preserves_norm_and_relative_position():
  x = jax.random.normal(jax.random.key(0), (1, 8, 2, 16))
  y = rotary(x, 10_000.0)
  np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
  # q_i . k_j depends on i - j only: the same vector at all positions gives a Toeplitz score matrix.
  v = jnp.broadcast_to(x[:, :1], x.shape)
  r = rotary(v, 10_000.0)[0, :, 0]
  s = r @ r.T
  np.testing.assert_allclose(s[1, 0], s[5, 4], rtol=1e-4)


def test_presets_follow_megablocks_sizes():
  assert (PRESETS["xs-dense"].d_model, PRESETS["xs-dense"].num_layers) == (512, 8)
  assert (PRESETS["small-moe"].d_model, PRESETS["small-moe"].num_layers) == (768, 12)
  assert (PRESETS["medium-moe"].d_model, PRESETS["medium-moe"].num_layers) == (1024, 24)
  for size in ("xs", "small", "medium"):
    moe = PRESETS[f"{size}-moe"]
    assert (moe.num_experts, moe.top_k, moe.moe_every) == (64, 1, 1)
    assert PRESETS[f"{size}-dense"].moe_every == 0
    # Top-1 MoE costs the dense model's FLOPs plus only the router's.
    dense_flops = PRESETS[f"{size}-dense"].flops_per_token(1024)
    assert dense_flops < moe.flops_per_token(1024) < 1.01 * dense_flops


def test_flops_per_token_by_hand():
  """Convention (PaLM, appendix B): 6 N + 12 L d T per token, N the matmul weights a token passes
  through (attention 4 d^2 per block, the feed-forward, the router, the output head; the embedding is a
  lookup), T the sequence length. Causal masking is not subtracted, as in PaLM and nanoGPT."""
  d, L, f, V, T = 32, 2, 64, 256, 16
  dense = TransformerConfig(d_model=d, num_layers=L, num_heads=4, d_ff=f)
  # N = 2 blocks * (attention 4 * 32 * 32 + MLP 2 * 32 * 64) + head 32 * 256 = 2 * (4096 + 4096) + 8192
  assert dense.flops_per_token(T) == 6 * 24_576 + 12 * 2 * 32 * 16 == 159_744
  # MoE in block 1 only, 4 experts, top-2: that block's feed-forward counts twice, plus the 32 x 4 router.
  moe = dense.replace(moe_every=2, num_experts=4, top_k=2)
  assert moe.flops_per_token(T) == 6 * (2 * 4096 + 4096 + (2 * 4096 + 128) + 8192) + 12 * 2 * 32 * 16 == 185_088
  # GLU experts have three d x f matrices.
  glu = moe.replace(glu=True, activation="silu")
  assert glu.flops_per_token(T) == 6 * (2 * 4096 + 6144 + (2 * 6144 + 128) + 8192) + 12_288 == 221_952


@pytest.mark.parametrize("cfg", [SMALL.replace(moe_every=0), SMALL, SMALL.replace(moe_every=1, top_k=2, glu=True)],
                         ids=["dense", "moe", "moe_glu_top2"])
def test_flops_per_token_matches_the_model_parameters(cfg):
  """An independent count of N from the model's own parameters: every weight matrix but the embedding,
  expert weights scaled by top_k / num_experts (a token meets top_k of the experts)."""
  state = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  n = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]:
    names = [getattr(k, "key", None) for k in path]
    if leaf.ndim < 2 or names == ["embed"]:
      continue  # norm scales are not matmuls; the embedding is a lookup
    n += leaf.size * cfg.top_k // cfg.num_experts if leaf.ndim == 3 and "ffn" in names else leaf.size
  T = 24
  assert cfg.flops_per_token(T) == 6 * n + 12 * cfg.num_layers * cfg.d_model * T


def test_bad_configs_give_clear_errors():
  with pytest.raises(ValueError, match="not divisible by num_heads"):
    TransformerConfig(d_model=100, num_layers=2, num_heads=3, d_ff=64)
  with pytest.raises(ValueError, match="Unknown preset 'xs-moee'.*Did you mean 'xs-moe'"):
    get_preset("xs-moee")
  with pytest.raises(ValueError, match="top_k"):
    SMALL.replace(top_k=9)
  with pytest.raises(ValueError, match="dtype"):
    SMALL.replace(dtype="float64")
  with pytest.raises(ValueError, match="max_seq_len"):
    Transformer(SMALL, rngs=nnx.Rngs(0))(jnp.zeros((1, 65), jnp.int32))
  with pytest.raises(ValueError, match=r"tokens must be \[batch, seq\] integers; got shape \(2,\)"):
    Transformer(SMALL, rngs=nnx.Rngs(0))(jnp.array([1, 2]))


@pytest.mark.parametrize("field,value,match", [
    ("glu", "False", "glu must be True or False; got 'False'"),  # a truthy string would turn GLU on
    ("renormalize", "False", "renormalize must be True or False or None"),
    ("token_rounding", 1, "token_rounding must be True or False"),
    ("rope_base", 0, "rope_base must be a finite number > 0"),  # NaN rotary frequencies
    ("rope_base", -10_000.0, "rope_base must be a finite number > 0"),
    ("rope_base", "1e4", "rope_base must be a finite number > 0"),
    ("num_experts", 0, "num_experts must be a positive int"),
    ("top_k", 0, "top_k must be a positive int"),
    ("moe_every", True, "moe_every must be an int >= 0"),
    ("remat", "full", "remat must be one of 'none', 'block', 'ffn', 'hidden'; got 'full'"),
])
def test_bad_fields_of_a_dense_config_fail_when_made(field, value, match):
  """Dense configs build no MoEConfig, so these are checked by TransformerConfig itself."""
  with pytest.raises(ValueError, match=f"TransformerConfig.{match}"):
    SMALL.replace(**{"moe_every": 0, field: value})


def _loss_grads_and_residual_bytes(cfg, tokens):
  """(loss, grads, bytes of what the backward keeps) of the model's training loss."""
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

  def loss(p):
    logits, stats = nnx.merge(graphdef, p)(tokens[:, :-1], rng=jax.random.key(3))
    return cross_entropy(logits, tokens[:, 1:]) + stats.aux_loss

  return loss_grads_and_kept_bytes(loss, params)


def test_remat_recomputes_the_same_gradients_from_fewer_kept_activations():
  """remat='hidden' keeps each feed-forward's input and its experts' rows, 'ffn' its input only, 'block' each block's:
  the backward recomputes the rest, so the loss and gradients are the float32 ones without remat, router jitter
  included (its rng is an input), and what the backward keeps shrinks in that order. Dense and MoE blocks mixed
  (SMALL: an MoE every other block)."""
  cfg = SMALL.replace(jitter_eps=0.1)
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 256)
  want_loss, want, kept = _loss_grads_and_residual_bytes(cfg, tokens)
  for mode in ("hidden", "ffn", "block"):
    loss, got, less = _loss_grads_and_residual_bytes(cfg.replace(remat=mode), tokens)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(w))), err_msg=mode)
    assert less < {"hidden": 0.7, "ffn": 0.98, "block": 0.7}[mode] * kept, (mode, less, kept)
    kept = less  # ffn keeps less than hidden, block less than ffn


def test_hidden_remat_reruns_only_the_first_products(monkeypatch):
  """remat='hidden' on the Hopper kernels (traced for the GPU, not run): the backward runs the fused MLP's first
  kernel (the products and activation, GLU's two) once more, and not its second product, whose output the region
  keeps; 'ffn' runs both again."""
  from sparsejax.kernels.gmm import mosaic
  from sparsejax.models.transformer import HIDDEN_POLICY
  from sparsejax.moe import expert_ffn
  from sparsejax.topology import make_topology
  monkeypatch.setattr(mosaic, "_interpret", lambda: None)  # the compiled kernels' jaxpr, which only a GPU runs
  E, d, f, rows = 3, 128, 256, 384
  sizes = jnp.asarray([128, 0, 256], jnp.int32)
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)

  def kernels(fn, glu):
    def loss(x, w_in, w_out, w_gate):
      y = expert_ffn(x * 2, None, w_in, w_out, w_gate=w_gate if glu else None, impl="mosaic",
                     activation=jax.nn.silu if glu else jax.nn.gelu, topology=make_topology(sizes, rows, 128))
      return jnp.sum(jnp.sin(y.astype(jnp.float32)))  # its backward needs y
    jaxpr = jax.make_jaxpr(jax.grad(fn(loss), argnums=(0, 1, 2, 3)))(
        spec(rows, d), spec(E, d, f), spec(E, f, d), spec(E, d, f)).jaxpr
    return sum(e.primitive.name == "custom_vmap_call" for e in jaxpr_equations(jaxpr))  # one a kernel

  for glu, plain in ((False, 6), (True, 8)):  # gelu: gmm_act, gmm, gmm_dact, two tgmm, dX; GLU: three tgmm, two dX
    assert kernels(lambda f: f, glu) == plain
    assert kernels(lambda f: jax.checkpoint(f, policy=HIDDEN_POLICY), glu) == plain + 1
    assert kernels(jax.checkpoint, glu) == plain + 2
