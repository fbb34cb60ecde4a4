"""A decoder-only Transformer LM in Flax NNX whose feed-forwards are the library's MLP or MoE.

logits, stats = model(tokens): pre-norm blocks h += Attn(RMSNorm(h)); h += FFN(RMSNorm(h)), rotary
positions, causal attention through jax.nn.dot_product_attention. Aux losses of the MoE layers are
summed into stats.aux_loss (already weighted); nothing is stashed in module state. cfg.remat ("hidden", "ffn",
"block") trades the backward's kept activations for a second forward of each feed-forward's hidden layer, each
feed-forward or each block (_rematerialized).

Decoding (sparsejax.inference.generate): model.init_cache(batch, length, start=...) adds nnx.Cache
variables (keys and values per block, the write index and the left-padding of each row), and
model(tokens, decode=True) appends tokens to that cache and attends over it.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from sparsejax._precision import dot_precision, dot_precision_scope
from sparsejax.models.config import DTYPES, TransformerConfig
from sparsejax.norm import rms_norm
from sparsejax.rope import rotary
from sparsejax import kernels
from sparsejax.kernels import skinny_matmul
from sparsejax.kernels.decode_attention import decode_attention
from sparsejax.kernels.decode_qkv import decode_qkv, runs_kernel as qkv_runs_kernel
from sparsejax.modules import MLP, MoE
from sparsejax.moe import EXPERT_OUT, EXPERT_ROWS
from sparsejax.inference import kv_cache


@flax.struct.dataclass
class ModelStats:
  """Per-model router statistics: per-MoE-layer arrays are stacked along a leading 'moe_layers' axis."""
  aux_loss: Float[Array, ""]
  load_balancing_loss: Float[Array, ""]
  router_z_loss: Float[Array, ""]
  tokens_per_expert: Int[Array, "moe_layers experts"]
  dropped_fraction: Float[Array, "moe_layers"]
  exchange_overflow: Int[Array, "moe_layers"]  # assignments past the expert-parallel exchange's buffer; 0 on one device


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32 and returned in x's dtype."""

  def __init__(self, dim: int, *, param_dtype=jnp.float32, eps: float = 1e-6):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
    return rms_norm(x, self.scale[...], self.eps)

  def folded(self) -> tuple[Float[Array, "d"], float]:
    """(scale, eps): the norm as the decode kernels take it, to apply it inside their products."""
    return self.scale[...], self.eps


def attention_impl(cfg: TransformerConfig) -> str | None:
  """cuDNN flash attention on GPU for half precision (it supports nothing else) from sm_80 on (cuDNN's fused flash
  attention needs Ampere or later); XLA otherwise."""
  if cfg.attention_impl == "auto":
    half = cfg.dtype in ("bfloat16", "float16")
    return "cudnn" if half and jax.default_backend() == "gpu" and not kernels.gpu_before_ampere() else None
  return None if cfg.attention_impl == "xla" else "cudnn"


class Attention(nnx.Module):
  """Causal multi-head self-attention: softmax(q k^T / sqrt(d_h) + causal mask) v, with RoPE on q, k."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = DTYPES[cfg.param_dtype]
    init = nnx.initializers.normal(0.02)
    d, h, dh = cfg.d_model, cfg.num_heads, cfg.head_dim
    self.w_qkv = nnx.Param(init(rngs.params(), (d, 3, h, dh), pd))
    # Scaled init of residual projections (GPT-2): keeps the residual stream's variance ~ constant in depth.
    out_init = nnx.initializers.normal(0.02 / (2 * cfg.num_layers) ** 0.5)
    self.w_out = nnx.Param(out_init(rngs.params(), (h, dh, d), pd))

  def init_cache(self, batch_size: int, max_length: int, dtype) -> None:
    """Preallocated keys and values for decode=True, as flax.nnx.MultiHeadAttention keeps them."""
    shape = (batch_size, max_length, self.cfg.num_heads, self.cfg.head_dim)
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))

  def _qkv(self, x, norm, folded, few_rows):
    """q, k, v [b, t, h, dh] of norm(x), before RoPE; a few rows take skinny_matmul with the norm folded."""
    cfg, dt = self.cfg, self.cfg.compute_dtype
    b, t, d = x.shape
    h, dh = cfg.num_heads, cfg.head_dim
    if few_rows:  # skinny_matmul reads each weight once; XLA's one-row dot writes x * W out, then sums it
      w_qkv = self.w_qkv[...].reshape(d, 3 * h * dh)
      qkv = skinny_matmul.skinny_matmul(x, w_qkv, norm=folded).astype(dt).reshape(b, t, 3, h, dh)
    else:
      if norm is not None:
        x = norm(x)
      qkv = jnp.einsum("btd,dchk->btchk", x, self.w_qkv[...].astype(dt), precision=dot_precision(dt))
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

  @jax.named_scope("attention")
  def __call__(self, x: Float[Array, "b t d"], *, cache: "DecodeView | None" = None,
               norm: "RMSNorm | None" = None, unsummed: bool = False) -> Float[Array, "b t d"]:
    """Attention of norm(x) (of x when norm is None); a decode step folds the norm into the qkv product.
    unsummed (a decode step of one row): the output product's split-K parts [p, rows, d] float32 instead
    (skinny_matmul.split_k_parts), for a kernel that adds them to the residual stream itself."""
    cfg, dt = self.cfg, self.cfg.compute_dtype
    b, t, d = x.shape
    h, dh = cfg.num_heads, cfg.head_dim
    # Float32 models ask for HIGHEST in every product (a GPU's default float32 dot is TF32); bf16
    # keeps the default. jax.nn.dot_product_attention takes no precision: it gets the scope.
    hi = dot_precision(dt)
    few_rows = cache is not None and b * t <= skinny_matmul.MAX_ROWS  # a decode step
    folded = None if norm is None else norm.folded()
    if cache is not None:
      if few_rows and t == 1 and qkv_runs_kernel(dh):
        # One token a row: the qkv product's split-K parts go straight to one kernel that sums them,
        # applies RoPE and writes the cache slot (XLA would run three kernels for that glue).
        parts = skinny_matmul.split_k_parts(x.reshape(b, d), self.w_qkv[...].reshape(d, 3 * h * dh), norm=folded)
        q, keys, values = decode_qkv(parts, self.cached_key[...], self.cached_value[...], cache.index, cache.start,
                                     rope_base=cfg.rope_base, dtype=dt)
        q = q[:, None]
      else:
        q, k, v = self._qkv(x, norm, folded, few_rows)
        q, k = rotary(q, cfg.rope_base, cache.positions), rotary(k, cfg.rope_base, cache.positions)
        keys = kv_cache.write(self.cached_key[...], k, cache.index)
        values = kv_cache.write(self.cached_value[...], v, cache.index)
      self.cached_key[...], self.cached_value[...] = keys, values
      if t == 1:  # one query per row: split-cache kernel on a GPU (XLA's lowering is ~8 small kernels)
        o = decode_attention(q[:, 0], keys, values, cache.start, cache.index)[:, None]
      else:
        with dot_precision_scope(dt):
          o = jax.nn.dot_product_attention(q, keys, values, mask=cache.mask)
      if few_rows:
        w_out = self.w_out[...].reshape(h * dh, d)
        if unsummed and b * t == 1:
          return skinny_matmul.split_k_parts(o.reshape(1, h * dh), w_out)
        return skinny_matmul.skinny_matmul(o.reshape(b, t, h * dh), w_out).astype(dt)
      return jnp.einsum("bthk,hkd->btd", o, self.w_out[...].astype(dt), precision=hi)
    q, k, v = self._qkv(x, norm, folded, few_rows)
    q, k = rotary(q, cfg.rope_base), rotary(k, cfg.rope_base)
    impl = attention_impl(cfg)
    with dot_precision_scope(dt):
      try:
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
      except Exception:  # cuDNN refuses some shapes/versions at trace time: fall back to XLA.
        if impl is None:
          raise
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return jnp.einsum("bthk,hkd->btd", o, self.w_out[...].astype(dt), precision=hi)


class Block(nnx.Module):
  """h = x + Attn(norm(x)); y = h + FFN(norm(h)); FFN is MoE or MLP, both returning (y, MoELayerStats)."""

  def __init__(self, cfg: TransformerConfig, moe: bool, *, rngs: nnx.Rngs, mesh=None):
    pd = DTYPES[cfg.param_dtype]
    self.attn_norm = RMSNorm(cfg.d_model, param_dtype=pd)
    self.attn = Attention(cfg, rngs=rngs)
    self.ffn_norm = RMSNorm(cfg.d_model, param_dtype=pd)
    self.is_moe = moe
    self.remat = cfg.remat
    self.ffn = MoE(cfg.moe_config(), rngs=rngs, mesh=mesh) if moe else MLP(cfg.moe_config(), rngs=rngs)

  def __call__(self, x: Float[Array, "b t d"], *, rng: jax.Array | None = None,
               cache: "DecodeView | None" = None):
    if cache is None:
      x = x + self.attn(self.attn_norm(x))
      if self.remat in ("ffn", "hidden"):
        y, stats = _rematerialized(lambda m, x, rng: m[1](m[0](x), rng=rng), (self.ffn_norm, self.ffn), x, rng,
                                   policy=HIDDEN_POLICY if self.remat == "hidden" else None)
      else:
        y, stats = self.ffn(self.ffn_norm(x), rng=rng)
    else:  # decoding: each layer applies its norm where it can fold it into its first products
      if self.is_moe and x.shape[0] * x.shape[1] == 1 and self.ffn.takes_pending(x, rng=rng):
        # one token: the router's kernel adds the attention's output to the residual stream
        pending = self.attn(x, cache=cache, norm=self.attn_norm, unsummed=True)
        return self.ffn(x, rng=rng, decode=True, norm=self.ffn_norm, pending=pending)
      x = x + self.attn(x, cache=cache, norm=self.attn_norm)
      # and the feed-forward adds the residual itself: at one token, in the kernel that sums its parts
      return self.ffn(x, rng=rng, decode=True, norm=self.ffn_norm, residual=x)
    return x + y.astype(x.dtype), stats


# remat="hidden": the feed-forward's region keeps the experts' input and output rows (moe.expert_ffn names them) and
# recomputes the rest, so the backward runs the norm, router, placement and first products again, but not the
# gather or exchange of the rows (a dense MLP keeps none: its norm and first product run again).
HIDDEN_POLICY = jax.checkpoint_policies.save_only_these_names(EXPERT_ROWS, EXPERT_OUT)


def _rematerialized(fn, modules, *args, policy=None):
  """fn(modules, *args) under jax.checkpoint: the backward keeps only the inputs (the modules' parameters, args) and
  runs fn's forward again; XLA's optimization barriers keep that recomputation in the backward. The parameters enter
  as plain arrays and are not returned (nnx.remat returns them), so train.cast_dtypes still sees each weight's one
  cast to the compute dtype and gives it a compute-dtype copy."""
  graphdef, state = nnx.split(modules)
  return jax.checkpoint(lambda s, *a: fn(nnx.merge(graphdef, s), *a), policy=policy)(state, *args)


@flax.struct.dataclass
class DecodeView:
  """What every block's attention needs in a decode call: where to write, RoPE positions, the mask
  (and the rows' left-padding, from which the one-query kernel builds the same mask)."""
  index: Int[Array, ""]
  positions: Int[Array, "b t"]
  mask: jax.Array  # bool [b, 1, t, cache_len]
  start: Int[Array, "b"]


class Transformer(nnx.Module):
  """logits[b, t] = W_head RMSNorm(blocks(Embed(tokens)))[b, t], predicting tokens[b, t + 1].

  Pass rng while training (router jitter); logits come back in float32 for a stable softmax.
  mesh (a sparsejax.mesh.make_expert_mesh mesh) makes the MoE layers expert-parallel over it; the
  parameters are the same either way, so a checkpoint moves between meshes.
  """

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, mesh=None):
    self.cfg = cfg
    pd = DTYPES[cfg.param_dtype]
    self.embed = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.d_model), pd))
    blocks = [Block(cfg, cfg.is_moe_layer(i), rngs=rngs, mesh=mesh) for i in range(cfg.num_layers)]
    self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
    self.final_norm = RMSNorm(cfg.d_model, param_dtype=pd)
    self.head = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.d_model, cfg.vocab_size), pd))

  def init_cache(self, batch_size: int, max_length: int, *, start: Int[Array, "b"] | None = None) -> None:
    """Adds the KV caches (nnx.Cache) that decode=True calls fill: max_length slots per row.

    start[b] (default 0) is the number of left-padding slots of row b: its slot s holds position
    s - start[b], and slots before start[b] are never attended to (see inference.kv_cache).
    """
    if not 1 <= max_length <= self.cfg.max_seq_len:
      raise ValueError(f"cache length {max_length} must lie in [1, max_seq_len={self.cfg.max_seq_len}].")
    start = jnp.zeros((batch_size,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
    if start.shape != (batch_size,):
      raise ValueError(f"start must have shape ({batch_size},); got {start.shape}.")
    self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))
    self.cache_start = nnx.Cache(start)
    for block in self.blocks:
      block.attn.init_cache(batch_size, max_length, self.cfg.compute_dtype)

  def __call__(self, tokens: Int[Array, "b t"], *, rng: jax.Array | None = None, decode: bool = False
               ) -> tuple[Float[Array, "b t vocab"], ModelStats]:
    cfg, dt = self.cfg, self.cfg.compute_dtype
    # Shapes are static, so this fails at trace time with one line, not an IndexError deep in the layers.
    if jnp.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
      raise ValueError(f"tokens must be [batch, seq] integers; got shape {jnp.shape(tokens)} of "
                       f"{jnp.result_type(tokens)}.")
    if tokens.shape[1] > cfg.max_seq_len:
      raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len={cfg.max_seq_len}.")
    cache = None
    if decode:
      if getattr(self, "cache_index", None) is None:
        raise ValueError("decode=True needs a KV cache: call model.init_cache(batch_size, max_length) first.")
      index, start = self.cache_index[...], self.cache_start[...]
      batch, length = self.blocks[0].attn.cached_key[...].shape[:2]
      if tokens.shape[0] != batch or tokens.shape[1] > length:
        raise ValueError(f"decode=True got tokens of shape {tokens.shape} for a cache of {batch} rows "
                         f"x {length} slots.")
      t = tokens.shape[1]
      cache = DecodeView(index, kv_cache.positions(index, start, t), kv_cache.mask(index, start, t, length),
                         start)
      self.cache_index[...] = index + t
    with jax.named_scope("embed"):
      h = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
    moe_stats = []
    for i, block in enumerate(self.blocks):
      layer_rng = None if rng is None else jax.random.fold_in(rng, i)
      if cache is None and cfg.remat == "block":
        h, s = _rematerialized(lambda b, h, rng: b(h, rng=rng), block, h, layer_rng)
      else:
        h, s = block(h, rng=layer_rng, cache=cache)
      if block.is_moe:
        moe_stats.append(s)
    h = self.final_norm(h)
    with jax.named_scope("lm_head"):
      logits = jnp.einsum("btd,dv->btv", h, self.head[...].astype(dt), preferred_element_type=jnp.float32,
                          precision=dot_precision(dt))  # HIGHEST for float32: no TF32 on a GPU
    return logits, _collect(moe_stats, cfg.num_experts)


def _collect(stats: list, num_experts: int) -> ModelStats:
  zero = jnp.zeros((), jnp.float32)
  if not stats:
    return ModelStats(zero, zero, zero, jnp.zeros((0, num_experts), jnp.int32), jnp.zeros((0,), jnp.float32),
                      jnp.zeros((0,), jnp.int32))
  total = lambda name: sum(getattr(s, name) for s in stats)
  return ModelStats(
      aux_loss=total("aux_loss"),
      load_balancing_loss=total("load_balancing_loss"),
      router_z_loss=total("router_z_loss"),
      tokens_per_expert=jnp.stack([s.tokens_per_expert for s in stats]),
      dropped_fraction=jnp.stack([s.dropped_fraction for s in stats]),
      exchange_overflow=jnp.stack([s.exchange_overflow for s in stats]),
  )


@jax.named_scope("cross_entropy")
def cross_entropy(logits: Float[Array, "b t v"], targets: Int[Array, "b t"]) -> Float[Array, ""]:
  """mean_{b,t} -log softmax(logits[b, t])[targets[b, t]] in nats (divide by ln 2 for bits per token)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
