"""Flax NNX modules: parameters, and a call into the functional core.

Expert weights carry the logical axis names ("expert", "embed", "mlp") that the expert-parallel
layer maps onto a mesh; the router is replicated.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import flax.struct
from flax import nnx
from jaxtyping import Array, Float

from sparsejax import losses, parallel, routing, token_rounding
from sparsejax._precision import dot_precision
from sparsejax.config import MoEConfig
from sparsejax.kernels import skinny_matmul
from sparsejax.kernels.decode_router import decode_router, router_logit_parts, runs_kernel, select_logit_parts
from sparsejax.mesh import expert_layout
from sparsejax.moe import expert_choice_mlp, moe_mlp
from sparsejax.parallel import ExpertParallelConfig




@flax.struct.dataclass
class MoELayerStats:
  """MoEStats plus the router's losses. aux_loss = lb_weight * load_balancing + z_weight * z_loss.

  exchange_overflow: under expert parallelism, the assignments past the exchange's buffer (ExpertParallelStats'),
  so computed by the slower fallback; 0 on one device."""
  tokens_per_expert: jax.Array
  num_dropped: jax.Array
  dropped_fraction: jax.Array
  load_balancing_loss: jax.Array
  router_z_loss: jax.Array
  aux_loss: jax.Array
  exchange_overflow: jax.Array


@functools.cache
def _sharding_key() -> str:
  """The Variable metadata key this flax reads logical axis names from: 'out_sharding' in current
  flax ('sharding_names' there is a deprecated alias, slated to go), 'sharding_names' before."""
  probe = nnx.Param(jnp.zeros((1,)), out_sharding=("probe",), eager_sharding=False)
  spec = nnx.get_partition_spec(probe)
  spec = spec.get_value() if hasattr(spec, "get_value") else spec.value
  return "out_sharding" if tuple(spec) == ("probe",) else "sharding_names"


def _param(value, names: tuple) -> nnx.Param:
  """A Param annotated with logical axis names; sharded later by whoever holds the mesh."""
  return nnx.Param(value, eager_sharding=False, **{_sharding_key(): names})


def _expert_init():
  # Each expert is its own dense layer: scale by its own fan-in, not E * fan-in.
  return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1)


class Router(nnx.Module):
  """logits = x W_r in float32 (selective precision), with Switch jitter when given an rng."""

  def __init__(self, d_model: int, num_experts: int, *, jitter_eps: float = 0.0,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    w = nnx.initializers.normal(0.02)(rngs.params(), (d_model, num_experts), param_dtype)
    self.w = _param(w, (None, None))
    self.jitter_eps = jitter_eps

  def __call__(self, x: Float[Array, "tokens d_model"], *, rng: jax.Array | None = None):
    return routing.router_logits(x, self.w[...], jitter_eps=self.jitter_eps, rng=rng)


class MoE(nnx.Module):
  """Mixture-of-experts feed-forward: y, stats = moe(x) for x of shape [..., d_model].

  Pass rng (a jax key) while training: it drives the router's jitter and the DTS gate's noise.
  """

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs, mesh=None, parallel=None):
    self.config = config
    c = config
    # --- expert parallelism (sparsejax.parallel): mesh=None keeps the single-device layer.
    self.mesh, self.parallel = mesh, parallel
    if mesh is not None:  # a wrong mesh fails here, in one line, not at the first call
      ep = parallel or ExpertParallelConfig()
      expert_layout(mesh, c.num_experts, data_axis=ep.data_axis, expert_axis=ep.expert_axis)
    if mesh is not None and c.router == "expert_choice":
      raise NotImplementedError("expert parallelism supports the token-choice routers only.")
    # ---
    self.router = Router(c.d_model, c.num_experts, jitter_eps=c.jitter_eps,
                         param_dtype=c.param_dtype, rngs=rngs)
    shape_in, shape_out = (c.num_experts, c.d_model, c.d_ff), (c.num_experts, c.d_ff, c.d_model)
    init = _expert_init()
    names_in, names_out = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")
    self.w_in = _param(init(rngs.params(), shape_in, c.param_dtype), names_in)
    self.w_gate = _param(init(rngs.params(), shape_in, c.param_dtype), names_in) if c.glu else None
    self.w_out = _param(init(rngs.params(), shape_out, c.param_dtype), names_out)

  def takes_pending(self, x: Float[Array, "... d_model"], *, rng: jax.Array | None = None) -> bool:
    """Whether a decode call at these tokens (with a norm) takes `pending`: one token whose router runs its two
    kernels (decode_router.splits_logits) with the norm folded. decode_moe.PENDING_RESIDUAL (read here, at trace
    time) turns it off."""
    from sparsejax.inference import decode_moe
    c = self.config
    x_in = x.reshape(-1, x.shape[-1])
    return (decode_moe.PENDING_RESIDUAL and rng is None and c.router == "top_k" and x_in.shape[0] == 1
            and x_in.dtype == jnp.dtype(c.dtype) and skinny_matmul.folds_norm(*x_in.shape, c.d_ff)
            and decode_moe.splits_logits(*x_in.shape, c.num_experts, c.top_k))

  def __call__(self, x: Float[Array, "... d_model"], *, rng: jax.Array | None = None,
               dts_temperature: float | jax.Array = 1.0, decode: bool = False, norm=None, residual=None,
               pending: Float[Array, "p rows d_model"] | None = None):
    """y, stats = moe(x): x [..., d_model] -> y of x's shape, and MoELayerStats (expert loads, drops, and the aux
    losses, whose weighted sum stats.aux_loss a training loss adds).

    rng (a jax key): pass it in training calls. It drives the router's jitter and the DTS gate's noise, and with
    MoEConfig.token_rounding it turns rounding on; calls without it (evaluation) route deterministically.
    dts_temperature: the dense-to-sparse gate's softmax temperature (router="dense_to_sparse").

    The rest is for generation (sparsejax.inference builds these calls):
    decode=True (generation, see sparsejax.inference) is dropless and reads only chosen experts.
    norm (an RMSNorm): the layer's input is norm(x); a top-k decode step folds it into the router's
    and the experts' first kernels (their `norm` argument) instead of running it on its own.
    residual (x's shape): the output is residual + y in residual's dtype (the block's add, which a decode
    step at one token may run inside the experts' last kernel, decode_moe_mlp).
    pending (decode, with norm, where takes_pending holds): the split-K parts of a product the block adds to x
    first (its attention's W_o); the layer's input and residual are then h = x + that product, which the
    router's kernel adds (decode_router.router_logit_parts), so no XLA kernel runs for the add."""
    c = self.config
    lead = x.shape[:-1]
    jitter_rng = gate_rng = None
    if rng is not None:
      jitter_rng, gate_rng = jax.random.split(rng)
    x_in = x.reshape(-1, x.shape[-1])
    res = None if residual is None else residual.reshape(x_in.shape)  # added below unless a layer adds it
    # Folded only where the expert products fold it too: if XLA normalizes x for them anyway, the
    # router taking the norm again would only add work.
    fold = (norm is not None and decode and c.router == "top_k" and jitter_rng is None
            and x_in.dtype == jnp.dtype(c.dtype) and skinny_matmul.folds_norm(*x_in.shape, c.d_ff))
    folded = norm.folded() if fold else None
    router_parts = None
    if pending is not None:
      if not (decode and norm is not None and residual is None and self.takes_pending(x, rng=rng)):
        raise ValueError("pending is for a decode step at one token with a norm and no residual, where "
                         "takes_pending(x) holds.")
      router_parts, x_in = router_logit_parts(x_in, self.router.w[...], norm=folded, pending=pending)
      res = x_in
    # x2, the layer's input, feeds whatever does not fold the norm (in a folded decode step only the
    # losses, which XLA drops); x_in is what the folding kernels take.
    x2 = (x_in if norm is None else norm(x_in)).astype(c.dtype)
    if not fold:
      x_in = x2
    logits = self.router(x2, rng=jitter_rng)
    cast = lambda p: None if p is None else p[...].astype(c.dtype)
    w_in, w_gate, w_out = cast(self.w_in), cast(self.w_gate), cast(self.w_out)
    if getattr(self, "w_in_scale", None) is not None:  # int8 experts (inference.quantize_model)
      from sparsejax.inference import decode_moe
      w = decode_moe.expert_weights(self, c.dtype, quantized=False)
      w_in, w_gate, w_out = w["w_in"], w["w_gate"], w["w_out"]
    act = c.activation_fn
    routed = False
    if c.router == "expert_choice":
      r = routing.expert_choice_routing(logits, c.capacity_factor)
      y, stats = expert_choice_mlp(x2, r, w_in, w_out, w_gate=w_gate, activation=act)
      # Expert choice balances load by construction; its f_i is uniform.
      lb = jnp.zeros((), jnp.float32)
    else:
      if c.router == "top_k":
        r = routing.top_k_routing(logits, c.top_k, renormalize=c.renormalize)
        if decode and jitter_rng is None and runs_kernel(*x2.shape, c.num_experts, c.top_k):
          from sparsejax.inference import decode_moe
          # One token: the experts' kernels select from the router's partial logits (routed_decode_layer).
          routed = res is not None and decode_moe.selects_in_experts(self, x_in, act)
          if not routed:
            # A decode step's few tokens: ids and weights from two kernels instead of XLA's six. The
            # probabilities and logits above then feed only the layer's losses, which XLA drops unless used.
            # (Where the kernels do not run, r already is what decode_router's reference would compute.)
            if router_parts is not None:  # the router's first kernel ran above (it added the pending product)
              ids, weights = select_logit_parts(router_parts, c.top_k, renormalize=c.renormalize)
            else:
              ids, weights = decode_router(x_in, self.router.w[...], c.top_k, renormalize=c.renormalize,
                                           norm=folded)
            r = r.replace(expert_ids=ids, combine_weights=weights)
      else:
        r = routing.dense_to_sparse_routing(logits, dts_temperature, c.dts_threshold,
                                            max_k=c.dts_max_k, rng=gate_rng)
      if routed:  # the block's residual is added in the experts' last kernel
        y, stats, ids = decode_moe.routed_decode_layer(self, x_in, activation=act, norm=folded, residual=res,
                                                       router_parts=router_parts)
        r, res = r.replace(expert_ids=ids), None
      else:
        layer = moe_mlp
        if self.mesh is not None:  # expert parallelism: same contract, experts sharded over the mesh
          layer = functools.partial(parallel.expert_parallel_moe_mlp, mesh=self.mesh,
                                    parallel=self.parallel or parallel.ExpertParallelConfig())
        if decode:  # generation: the small-batch path of sparsejax.inference (reads int8 as stored)
          from sparsejax.inference import decode_moe
          layer = functools.partial(decode_moe.moe_decode_layer, self, norm=folded, residual=res)
          res = None
        if c.token_rounding and rng is not None and not decode:  # training: whole blocks, no padding rows
          y, stats = token_rounding.rounded_moe_mlp(x_in, r, w_in, w_out, w_gate=w_gate, activation=act,
                                                    impl=c.impl, mesh=self.mesh, parallel=self.parallel)
        else:
          # The combine weights stay float32: the combine is float32, and bf16 would round them.
          y, stats = layer(x_in, r.expert_ids, r.combine_weights, w_in, w_out,
                           w_gate=w_gate, activation=act, capacity_factor=c.capacity_factor,
                           impl=c.impl)
      lb = losses.load_balancing_loss(r.router_probs, r.expert_ids)
    z = losses.router_z_loss(logits)
    layer_stats = MoELayerStats(
        tokens_per_expert=stats.tokens_per_expert,
        num_dropped=stats.num_dropped,
        dropped_fraction=stats.dropped_fraction,
        load_balancing_loss=lb,
        router_z_loss=z,
        aux_loss=c.load_balancing_weight * lb + c.z_loss_weight * z,
        exchange_overflow=getattr(stats, "exchange_overflow", jnp.zeros((), jnp.int32)),
    )
    if res is not None:
      y = res + y.astype(res.dtype)
    return y.reshape(*lead, c.d_model), layer_stats


class MLP(nnx.Module):
  """The dense feed-forward of the same interface (config, call, (y, stats)), for comparisons."""

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
    self.config = config
    c = config
    init = nnx.initializers.lecun_normal()
    shape_in, shape_out = (c.d_model, c.d_ff), (c.d_ff, c.d_model)
    self.w_in = _param(init(rngs.params(), shape_in, c.param_dtype), ("embed", "mlp"))
    self.w_gate = _param(init(rngs.params(), shape_in, c.param_dtype), ("embed", "mlp")) if c.glu else None
    self.w_out = _param(init(rngs.params(), shape_out, c.param_dtype), ("mlp", "embed"))

  @jax.named_scope("dense_mlp")
  def __call__(self, x: Float[Array, "... d_model"], *, rng: jax.Array | None = None, decode: bool = False,
               norm=None, residual=None, **unused):
    """decode=True (generation) runs the products of a few rows through skinny_matmul. norm (an
    RMSNorm): the input is norm(x), folded into the first products' kernels in a decode step.
    residual (x's shape): the output is residual + y in residual's dtype, in a decode step through
    skinny_ffn_residual (one kernel with the sum of the row form's parts where it fuses)."""
    del rng, unused
    c = self.config
    # HIGHEST for float32 (a GPU's default float32 dot is TF32); bf16 keeps the default.
    hi = dot_precision(c.dtype)
    rows = x.size // c.d_model
    gate = None if self.w_gate is None else self.w_gate[...]
    skinny = decode and rows <= skinny_matmul.MAX_ROWS
    folded = None
    if skinny and norm is not None and x.dtype == jnp.dtype(c.dtype):
      folded, norm = norm.folded(), None
    if norm is not None:
      x = norm(x)
    x = x.astype(c.dtype)
    if skinny and residual is not None:  # the block's add too, after the products' kernels
      y = skinny_matmul.skinny_ffn_residual(x.reshape(-1, c.d_model), self.w_in[...], self.w_out[...],
                                            residual.reshape(-1, c.d_model), w_gate=gate,
                                            activation=c.activation_fn, norm=folded).reshape(residual.shape)
      residual = None
    elif skinny:  # one call: the hidden layer may run inside W_out's kernel
      y = skinny_matmul.skinny_ffn(x, self.w_in[...], self.w_out[...], w_gate=gate, activation=c.activation_fn,
                                   norm=folded).astype(c.dtype)
    else:
      matmul = lambda a, w: jnp.matmul(a, w.astype(c.dtype), precision=hi)
      h = matmul(x, self.w_in[...])
      h = c.activation_fn(matmul(x, gate)) * h if gate is not None else c.activation_fn(h)
      y = matmul(h, self.w_out[...])
    zero = jnp.zeros((), jnp.float32)
    n = jnp.asarray(x.size // c.d_model, jnp.int32)
    stats = MoELayerStats(n[None], jnp.zeros((), jnp.int32), zero, zero, zero, zero, jnp.zeros((), jnp.int32))
    if residual is not None:
      y = residual + y.astype(residual.dtype)
    return y, stats
