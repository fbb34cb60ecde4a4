"""Train a Transformer LM: `sparsejax-train --preset tiny` (see `--help`), or train(TrainConfig(...)).

The loop: data -> jitted step (AdamW, warm-up + cosine, clipping, aux losses) -> log -> checkpoint.
Runs resume exactly from the latest finished checkpoint in `out/checkpoints` (params, optimizer,
data position and step; the step's rng is fold_in(seed, step)), so a killed run restarted with
the same command continues the same loss curve. With a compute dtype unlike the params' (bf16
over float32), the step also carries the bf16 copy of the weights the forward casts, written by
the optimizer (make_steps(with_copy=True)); checkpoints hold only the params it derives from.

train(cfg) = run(prepare(cfg)): prepare checks everything a user can get wrong (preset, data,
sequence length, an existing run of another model in `out`) without compiling or writing
anything, so a bad command fails at once and leaves no folder behind.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import pathlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from sparsejax import distributed, loss_scale
from sparsejax.checkpoint import Checkpointer
from sparsejax.cli import main, parse_args  # noqa: F401  (sparsejax.train:main, the old entry point)
from sparsejax.mesh import DATA, EXPERT, EXPERT_GROUP, expert_layout, logical_to_mesh, make_expert_mesh
from sparsejax.data import BUILT_IN, BatchStream, Corpus, eval_batches, load_corpus
from sparsejax.models import Transformer, TransformerConfig, cross_entropy
from sparsejax.train_config import TrainConfig

# optax.global_norm is deprecated in newer optax; older ones lack optax.tree.norm.
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm

# Dense bf16 peak FLOP/s per chip, for MFU. Unknown devices (e.g. CPUs) report no MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12,
              "L4": 121e12, "TPU v4": 275e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12}


def functional(model: nnx.Module) -> tuple[Callable, dict]:
  """(apply, params): apply(params, *args, **kw) = model(*args, **kw) with params a pure dict of arrays."""
  graphdef, state = nnx.split(model)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)

  def apply(params, *args, **kwargs):
    s = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(s, params)
    return nnx.merge(graphdef, s)(*args, **kwargs)

  return apply, nnx.to_pure_dict(state)


def make_optimizer(cfg: TrainConfig, *, loss_scaling: bool = False) -> optax.GradientTransformation:
  """clip(g, grad_clip) -> AdamW(b2=0.95) with lr: linear warm-up, cosine decay to min_lr_ratio * lr.

  Weight decay skips vectors (norm scales): decaying them only shrinks the residual stream.
  adam_mu_dtype="bfloat16" stores the first moment in bf16 (optax's mu_dtype; the update math
  stays float32), for optimizer steps bound by the bytes of many expert parameters.
  loss_scaling=True (float16 compute; run() sets it) wraps the chain in loss_scale.dynamic_loss_scale, whose
  scale make_steps' train_step reads from the state.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, max(1, cfg.warmup), max(cfg.steps, cfg.warmup + 1), cfg.lr * cfg.min_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                   optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask,
                               mu_dtype=jnp.dtype(cfg.adam_mu_dtype)))
  return loss_scale.dynamic_loss_scale(tx) if loss_scaling else tx


def cast_dtypes(apply: Callable, params: dict, *args, **kwargs) -> dict:
  """The params the forward casts before anything else: d for a leaf p whose one use in
  apply(params, *args, **kwargs) is p.astype(d) with d != p.dtype, None for every other leaf.

  Read from the forward's jaxpr, so it is what the model does, not a list of names: for the
  Transformer the attention, FFN, expert and head weights are cast to the compute dtype first
  thing; the router's weight (a float32 matmul), the embedding (gathered, then cast) and the
  norm scales (float32) come back None, and so does everything when the compute dtype is the
  params'. A leaf used twice stays None: a copy would sum the two uses' gradients in the compute
  dtype, where the two casts' transposes sum them in float32.
  """
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "dtype") else a
  jaxpr = jax.make_jaxpr(lambda p, a, kw: apply(p, *a, **kw))(*jax.tree.map(spec, (params, args, kwargs))).jaxpr
  uses = {}  # jaxpr -> {id(var): the eqns that use it (None: returned)}, keyed by id: literals need not hash

  def cast_to(jaxpr, v):
    """d where v's one use in jaxpr is a cast to d != v's dtype (looking inside rematerialized regions)."""
    if id(jaxpr) not in uses:
      table = uses[id(jaxpr)] = collections.defaultdict(list)
      for eqn in jaxpr.eqns:
        for u in eqn.invars:
          table[id(u)].append(eqn)
      for u in jaxpr.outvars:
        table[id(u)].append(None)
    (eqn,) = uses[id(jaxpr)][id(v)] if len(uses[id(jaxpr)][id(v)]) == 1 else (None,)
    if eqn is not None and eqn.primitive.name in _REMAT_PRIMITIVES:
      inner = eqn.params["jaxpr"]
      at = next(i for i, u in enumerate(eqn.invars) if u is v)  # by identity, as the table: Literals need no ==
      return cast_to(inner, inner.invars[at])
    if eqn is None or eqn.primitive.name != "convert_element_type":
      return None
    dtype = jnp.dtype(eqn.params["new_dtype"])
    return None if dtype == v.aval.dtype else dtype

  leaves = [cast_to(jaxpr, v) for v in jaxpr.invars[:len(jax.tree.leaves(params))]]
  return jax.tree.unflatten(jax.tree.structure(params), leaves)


# Rematerialized regions (TransformerConfig.remat) take their inputs one for one as the region's jaxpr's, so a
# weight's one use may be a cast inside one. jax 0.10 names the primitive remat2.
_REMAT_PRIMITIVES = ("checkpoint", "remat2", "remat")


def compute_copy(params: dict, dtypes: dict) -> dict:
  """copy[leaf] = params[leaf].astype(dtypes[leaf]) where dtypes (cast_dtypes') names one, None elsewhere."""
  return jax.tree.map(lambda d, p: None if d is None else p.astype(d), dtypes, params, is_leaf=_is_none)


def _is_none(v) -> bool:
  return v is None


def make_steps(apply: Callable, tx: optax.GradientTransformation, seed: int, *, shardings=None,
               with_copy: bool = False, grad_accum: int = 1):
  """train_step(params, opt, x, y, step) -> (params, opt, metrics); eval_step(params, x, y) -> loss.

  with_copy=True: train_step(params, opt, x, y, step, copy) -> (params, opt, metrics, copy), copy =
  compute_copy(params, cast_dtypes(...)) the compute-dtype weights, made from the params once and
  then by each step. The forward reads w_c = copy[leaf] where params[leaf].astype(d) stood, the
  gradient dL/dw_c is upcast to the param's dtype (what the cast's transpose did), AdamW updates the
  params as before, and the step returns the copy of the updated params, a cast that XLA can fuse
  into the update (XLA:CPU keeps it apart). The same numbers bit for bit, without the forward's
  cast of every weight: reading 4 and writing 2 bytes per parameter becomes writing 2. The copy is
  derived state: checkpoints leave it out, and a restored run rebuilds it from the params.
  shardings=(params', opt_state's): the step returns its state laid out as it came (a mesh run),
  each copied leaf as its param.
  grad_accum=A: the batch's rows are A microbatches (rows i, i + A, i + 2A, ...: each device keeps
  its share of every one), run one after another in a scan; AdamW then takes the mean of their
  gradients, one update per batch (eval_step also runs a microbatch at a time). The loss and the
  float stats are the microbatches' means, the counts (tokens per expert) their sums. Each
  microbatch's auxiliary losses are its own, as in Megatron; A=1 is the plain step, bit for bit.
  Where tx keeps a loss scale S (loss_scale.dynamic_loss_scale), the gradients are those of S times the loss,
  divided by S before tx sees them, and the metrics carry S after the update (halved: the step was skipped).
  """

  def loss_fn(params, x, y, rng):
    logits, stats = apply(params, x, rng=rng)
    ce = cross_entropy(logits, y)
    return ce + stats.aux_loss, (ce, stats)

  def value_and_grad(f, scale):
    """jax.value_and_grad(f, has_aux=True), of scale * f's loss where scale is not None (the value unscaled)."""
    if scale is None:
      return jax.value_and_grad(f, has_aux=True)

    def scaled(*args):
      loss, aux = f(*args)
      return loss * scale.astype(loss.dtype), (loss, aux)

    def value_and_grads(*args):
      (_, value), grads = jax.value_and_grad(scaled, has_aux=True)(*args)
      return value, grads
    return value_and_grads

  def loss_and_grads(params, x, y, rng, scale=None):
    return value_and_grad(loss_fn, scale)(params, x, y, rng)

  def loss_and_grads_via_copy(params, copy, x, y, rng, scale=None):
    """loss_and_grads, the forward reading the copy: dL/dp = upcast(dL/dw_c) where a copy stands in."""
    rest = jax.tree.map(lambda c, p: p if c is None else None, copy, params, is_leaf=_is_none)
    merge = lambda w: jax.tree.map(lambda c, p: p if c is None else c, *w, is_leaf=_is_none)
    value, (g_copy, g_rest) = value_and_grad(lambda w: loss_fn(merge(w), x, y, rng), scale)((copy, rest))
    return value, jax.tree.map(lambda g, r, p: r if g is None else g.astype(p.dtype), g_copy, g_rest, params,
                               is_leaf=_is_none)

  def unscaled(grads, scale):
    return grads if scale is None else jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)

  def split(a):
    """[B, ...] -> [A, B / A, ...], microbatch i = rows i, i + A, ...: with the batch split over devices
    in contiguous blocks, each microbatch takes rows of every block and stays spread over all of them."""
    return a.reshape(a.shape[0] // grad_accum, grad_accum, *a.shape[1:]).swapaxes(0, 1)

  def accumulated(grad_fn, x, y, rng):
    """grad_fn(x, y, rng) -> ((loss, (ce, stats)), grads), over grad_accum microbatches of x, y."""
    if grad_accum == 1:
      return grad_fn(x, y, rng)
    xs = (jnp.arange(grad_accum), split(x), split(y))
    shapes = jax.eval_shape(lambda xy: grad_fn(xy[1], xy[2], rng), jax.tree.map(lambda a: a[0], xs))

    def body(total, item):
      i, xb, yb = item
      out = grad_fn(xb, yb, jax.random.fold_in(rng, i))
      return jax.tree.map(jnp.add, total, out), None

    total, _ = lax.scan(body, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), xs)
    mean = lambda a: a / grad_accum if jnp.issubdtype(a.dtype, jnp.floating) else a
    return jax.tree.map(mean, total)

  def update(params, opt_state, loss, ce, stats, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(loss=loss, ce=ce, aux_loss=stats.aux_loss, lb_loss=stats.load_balancing_loss,
                   z_loss=stats.router_z_loss, grad_norm=_global_norm(grads),
                   tokens_per_expert=stats.tokens_per_expert, dropped_fraction=stats.dropped_fraction,
                   exchange_overflow=stats.exchange_overflow)
    scale = loss_scale.loss_scale(opt_state)
    if scale is not None:
      metrics["loss_scale"] = scale
    return params, opt_state, metrics

  if with_copy:
    def train_step(params, opt_state, x, y, step, copy):
      rng, scale = jax.random.fold_in(jax.random.key(seed), step), loss_scale.loss_scale(opt_state)
      (loss, (ce, stats)), grads = accumulated(
          lambda xb, yb, r: loss_and_grads_via_copy(params, copy, xb, yb, r, scale), x, y, rng)
      params, opt_state, metrics = update(params, opt_state, loss, ce, stats, unscaled(grads, scale))
      return params, opt_state, metrics, compute_copy(params, jax.tree.map(lambda c: c.dtype, copy))
  else:
    def train_step(params, opt_state, x, y, step):
      rng, scale = jax.random.fold_in(jax.random.key(seed), step), loss_scale.loss_scale(opt_state)
      (loss, (ce, stats)), grads = accumulated(lambda xb, yb, r: loss_and_grads(params, xb, yb, r, scale), x, y,
                                               rng)
      return update(params, opt_state, loss, ce, stats, unscaled(grads, scale))

  def eval_step(params, x, y):
    """The batch's mean cross-entropy; with grad_accum, a microbatch at a time (the same memory as
    training), the mean of their means (equal sizes)."""
    if grad_accum == 1:
      return cross_entropy(apply(params, x)[0], y)
    return jnp.mean(lax.map(lambda xy: cross_entropy(apply(params, xy[0])[0], xy[1]), (split(x), split(y))))

  out = None
  if shardings is not None:  # a copy's leaves lie as their params': shardings[0] is a prefix of the copy
    out = (*shardings, None, shardings[0]) if with_copy else (*shardings, None)
  donate = (0, 1, 5) if with_copy else (0, 1)
  return jax.jit(train_step, donate_argnums=donate, out_shardings=out), jax.jit(eval_step)


def peak_flops(device_kind: str, num_devices: int, per_device: float | None = None) -> float | None:
  """Peak FLOP/s of the devices a run computes on: per_device (or PEAK_FLOPS[kind]) * num_devices."""
  if per_device is None:
    per_device = next((v for k, v in PEAK_FLOPS.items() if k.lower() in device_kind.lower()), None)
  return None if per_device is None else per_device * num_devices


def mfu(flops_per_step: float, steps: int, seconds: float, peak: float | None) -> float | None:
  """Model FLOPs utilization: (steps * flops_per_step / seconds) / peak, None without a known peak."""
  return None if not peak else steps * flops_per_step / seconds / peak


def mesh_from_config(cfg: TrainConfig):
  """The (data, [expert_group,] expert) mesh of cfg.mesh, None without one."""
  if cfg.mesh is None:
    return None
  shape = cfg.mesh_shape()
  return make_expert_mesh(shape["data"], shape["expert"], expert_groups=shape.get("expert_group"))


def expert_axes(mesh) -> str | tuple[str, str]:
  """The mesh axes that shard experts: ("expert_group", "expert") on a two-level mesh, else "expert"."""
  return (EXPERT_GROUP, EXPERT) if EXPERT_GROUP in mesh.axis_names else EXPERT


def build_model(cfg: TrainConfig, model_cfg: TransformerConfig, expert_mesh=None, parallel=None) -> Transformer:
  """Transformer(model_cfg) whose MoE layers run expert-parallel over expert_mesh, with `parallel`
  (an ExpertParallelConfig) or, by default, the config's and the mesh's: cfg.ep_buffer_factor's buffers,
  and on a two-level mesh the hierarchical all-to-all (across expert groups, then within one)."""
  model = Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed), mesh=expert_mesh)
  two_level = expert_mesh is not None and EXPERT_GROUP in expert_mesh.axis_names
  if parallel is None and expert_mesh is not None and (two_level or cfg.ep_buffer_factor is not None):
    from sparsejax.parallel import ExpertParallelConfig
    axes = dict(expert_axis=expert_axes(expert_mesh), hierarchical=True) if two_level else {}
    parallel = ExpertParallelConfig(buffer_factor=cfg.ep_buffer_factor, **axes)
  if expert_mesh is not None and parallel is not None:
    for block in model.blocks:
      if block.is_moe:
        block.ffn.parallel = parallel  # static: part of the graphdef, as MoE(parallel=...) would set it
  return model


def init_model(cfg: TrainConfig, model_cfg: TransformerConfig, expert_mesh=None, parallel=None):
  """A fresh model, or the sparse upcycling of a dense checkpoint when cfg.upcycle_from is set.

  expert_mesh: the MoE layers run expert-parallel over it (same parameters as without), with
  `parallel` as in build_model.
  """
  model = build_model(cfg, model_cfg, expert_mesh, parallel)
  if cfg.upcycle_from is not None:
    from sparsejax.upcycle import load_dense_and_upcycle
    nnx.update(model, nnx.state(load_dense_and_upcycle(cfg.upcycle_from, model_cfg, seed=cfg.seed)))
  return model


def _shard(mesh, tree, spec):
  """The multi-device hook: with a mesh (Auto axes), batches split over spec, params replicate."""
  if mesh is None:
    return tree
  return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(*spec)))


def global_batch(mesh, local: tuple) -> tuple:
  """This process's rows of a batch -> the global batch, split over the mesh's batch axes. Each
  process passes its own contiguous block (data.process_rows), which make_array_from_process_local_data
  places on that process's devices (the mesh lists devices process by process)."""
  sharding = NamedSharding(mesh, PartitionSpec(*batch_axes(mesh)))
  return tuple(jax.make_array_from_process_local_data(sharding, np.asarray(a)) for a in local)


def batch_axes(mesh) -> tuple:
  """Batch rows split over "data" and, on an expert mesh, the expert axes too (every device its own tokens)."""
  return (tuple(a for a in (DATA, EXPERT_GROUP, EXPERT) if a in mesh.axis_names),)


def param_shardings(model: nnx.Module, mesh, num_experts: int) -> dict:
  """Expert weights (logical names ("expert", ...)) sharded over the mesh's expert axis by the MoE
  layer's layout (d_ff over the slice axis when experts are fewer than devices); all else replicated."""
  replicated = NamedSharding(mesh, PartitionSpec())
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))

  def place(spec):
    if EXPERT not in tuple(spec):
      return replicated
    layout = expert_layout(mesh, num_experts, expert_axis=expert_axes(mesh))
    return layout.sharding(logical_to_mesh(tuple(spec), layout))
  return jax.tree.map(place, specs, is_leaf=lambda s: isinstance(s, PartitionSpec))


def expert_parallel_state(model: nnx.Module, params, tx: optax.GradientTransformation, mesh, num_experts: int):
  """(params, opt_state, their shardings) laid out on an expert mesh: expert weights and their AdamW
  moments sharded (zeros_like keeps a sharding), the rest and the optimizer's scalars replicated
  (jit wants every state array on the mesh)."""
  params = jax.device_put(params, param_shardings(model, mesh, num_experts))
  opt_state = tx.init(params)
  on_mesh = lambda a: a.sharding if isinstance(a.sharding, NamedSharding) else NamedSharding(mesh, PartitionSpec())
  shardings = jax.tree.map(on_mesh, (params, opt_state))
  params, opt_state = jax.device_put((params, opt_state), shardings)
  return params, opt_state, shardings


class MetricsLog:
  """Appends one JSON object per line; after a resume, readers keep the last record of each step."""

  def __init__(self, path: pathlib.Path | None):
    self.file = None
    if path is not None:
      path.parent.mkdir(parents=True, exist_ok=True)
      self.file = open(path, "a")

  @classmethod
  def null(cls) -> "MetricsLog":
    """A log that writes nothing (the processes other than 0 of a multi-process run)."""
    return cls(None)

  def write(self, **record: Any) -> None:
    if self.file is not None:
      self.file.write(json.dumps(record) + "\n")
      self.file.flush()


@dataclasses.dataclass(frozen=True)
class Plan:
  """What prepare() found: the resolved model config, the corpus, and the step an existing run reached."""
  cfg: TrainConfig
  model_cfg: TransformerConfig
  corpus: Corpus
  resume_step: int | None


def _config_diff(saved: dict, now: dict) -> str:
  keys = sorted(set(saved) | set(now))
  return "; ".join(f"{k} {saved.get(k)!r} there, {now.get(k)!r} now" for k in keys if saved.get(k) != now.get(k))


def _corpus_where(name: str) -> str:
  """A corpus's identity across working directories: a built-in name as it is, a path resolved."""
  return name if name in BUILT_IN else str(pathlib.Path(name).expanduser().resolve())


def _same_corpus(meta: dict, now: str) -> bool:
  """Whether a checkpoint's run trained on the corpus named now (a checkpoint that recorded none: yes)."""
  saved = meta.get("corpus_where", meta.get("corpus"))
  return saved is None or saved == now or saved == _corpus_where(now)


def _check_upcycle_source(path: str, model_cfg: TransformerConfig) -> None:
  """The dense run to upcycle exists, has a finished checkpoint, and fits model_cfg."""
  from sparsejax.upcycle import SHARED_FIELDS
  folder = pathlib.Path(path)
  folder = folder / "checkpoints" if (folder / "checkpoints").is_dir() else folder
  if not folder.is_dir():
    raise FileNotFoundError(f"--upcycle-from {path!r}: no such run folder.")
  ckpt = Checkpointer(folder)
  try:
    if ckpt.latest_step() is None:
      raise FileNotFoundError(f"--upcycle-from {path!r}: no finished checkpoint in {str(folder)!r}.")
    dense = ckpt.restore_meta()["model_config"]
  finally:
    ckpt.close()
  differ = [f"{k} {dense.get(k)!r} there, {getattr(model_cfg, k)!r} here" for k in SHARED_FIELDS
            if dense.get(k) != getattr(model_cfg, k)]
  if differ:
    raise ValueError(f"--upcycle-from {path!r} holds a model that does not fit --preset "
                     f"({'; '.join(differ)}): upcycle into the MoE twin of its preset.")
  if dense.get("moe_every"):
    raise ValueError(f"--upcycle-from {path!r} holds an MoE model (moe_every={dense['moe_every']}); upcycling starts "
                     "from a dense run.")
  if model_cfg.moe_every == 0:
    raise ValueError("--upcycle-from needs an MoE --preset (the dense run's MoE twin).")


def state_bytes_per_device(cfg: TrainConfig, model_cfg: TransformerConfig) -> int:
  """Bytes a device holds for the parameters and AdamW's two moments: sum over leaves of size x (param + second
  moment + first moment bytes), the expert weights' divided over --mesh's expert axes (expert_group x expert), the
  rest replicated. A lower bound of what training holds: the compute-dtype copy and the step's buffers come on top."""
  abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
  state = nnx.state(abstract, nnx.Param)
  is_spec = lambda s: isinstance(s, PartitionSpec)
  specs = jax.tree.leaves(nnx.to_pure_dict(nnx.get_partition_spec(state)), is_leaf=is_spec)
  shape = cfg.mesh_shape() or {}
  expert_shards = shape.get(EXPERT, 1) * shape.get(EXPERT_GROUP, 1)
  mu = jnp.dtype(cfg.adam_mu_dtype).itemsize
  total = 0
  for leaf, spec in zip(jax.tree.leaves(nnx.to_pure_dict(state)), specs):
    per = leaf.size * (2 * leaf.dtype.itemsize + mu)
    total += per // expert_shards if EXPERT in tuple(spec) else per
  return total


def _check_state_memory(cfg: TrainConfig, model_cfg: TransformerConfig) -> None:
  """The parameters and AdamW's moments fit the devices' free memory (where the backend reports it). Without this
  check a model that cannot fit is found by the allocator, which on a GPU may retry for minutes first."""
  free = free_device_bytes(jax.local_devices())
  if free is None:
    return
  need = state_bytes_per_device(cfg, model_cfg)
  if need <= free:
    return
  hints = ["a smaller --preset"]
  if cfg.adam_mu_dtype == "float32":
    hints.append("--adam-mu-dtype bfloat16 (2 bytes a parameter less)")
  if model_cfg.moe_every and len(jax.devices()) > (cfg.mesh_shape() or {}).get(EXPERT, 1):
    hints.append(f"--mesh expert=N over more of the {len(jax.devices())} devices (the experts' weights split over N)")
  raise ValueError(f"the parameters and AdamW's moments need {need / 2**30:.1f} GiB a device and "
                   f"{free / 2**30:.1f} GiB is free: pass {', or '.join(hints)}.")


def _check_mesh(cfg: TrainConfig, model_cfg: TransformerConfig) -> None:
  """--mesh fits the visible devices, the batch and the experts (dividing them, or sliced by them)."""
  shape = cfg.mesh_shape()
  expert, groups = shape["expert"], shape.get("expert_group")
  n, visible = math.prod(shape.values()), jax.device_count()
  if n > visible:
    raise ValueError(f"--mesh {cfg.mesh} needs {n} devices; {visible} {'is' if visible == 1 else 'are'} visible.")
  if jax.process_count() > 1 and n != visible:
    raise ValueError(f"--mesh {cfg.mesh} covers {n} devices; with {jax.process_count()} processes it must "
                     f"cover all {visible} of them.")
  if cfg.batch_size % (n * cfg.grad_accum):
    what = (f"--batch-size {cfg.batch_size}" if cfg.grad_accum == 1 else
            f"A microbatch of --batch-size {cfg.batch_size} / --grad-accum {cfg.grad_accum}")
    raise ValueError(f"{what} does not split over the {n} devices of --mesh {cfg.mesh}: "
                     f"pass a --batch-size that is a multiple of {n * cfg.grad_accum}.")
  e, f = model_cfg.num_experts, model_cfg.d_ff
  if model_cfg.moe_every and groups is not None and e % (groups * expert):
    raise ValueError(f"--mesh {cfg.mesh}: expert_group x expert = {groups * expert} devices must divide "
                     f"num_experts={e} (expert slicing needs a single expert axis: leave out expert_group).")
  if model_cfg.moe_every and e % expert and (expert % e or f % (expert // e)):
    raise ValueError(f"--mesh {cfg.mesh}: expert={expert} must divide num_experts={e}, or be a multiple of it "
                     f"whose ratio divides d_ff={f} (expert slicing).")


def prepare(cfg: TrainConfig) -> Plan:
  """Check a run before anything is compiled or written; every user error is a one-line exception.

  Raises ValueError or OSError for an unknown preset, a bad --set, missing, empty, binary
  or too short data, and an `out` that holds a run of another model config.
  Of several processes (distributed.initialize_from_env, started here), a run without --mesh is
  data-parallel over all their devices.
  """
  distributed.initialize_from_env()
  if cfg.mesh is None and jax.process_count() > 1:
    cfg = dataclasses.replace(cfg, mesh=f"data={jax.device_count()}")
  out = pathlib.Path(cfg.out)
  existing = next(p for p in (out, *out.absolute().parents) if p.exists())
  if not existing.is_dir():
    raise ValueError(f"--out {cfg.out!r}: {str(existing)!r} is a file, not a folder.")
  if not os.access(existing, os.W_OK):
    raise PermissionError(f"--out {cfg.out!r}: cannot write in {str(existing)!r}.")
  unknown = set(cfg.model_overrides) - {f.name for f in dataclasses.fields(TransformerConfig)}
  if unknown:
    raise ValueError(f"--set {', '.join(sorted(unknown))}: not a TransformerConfig field; the fields are "
                     f"{', '.join(f.name for f in dataclasses.fields(TransformerConfig))}.")
  model_cfg = cfg.model_config()
  if model_cfg.dtype == "float16" and jax.default_backend() == "cpu":
    # XLA:CPU's dot_general has no float16 x float16 -> float32 form, which the attention asks for: the
    # step would fail while compiling, with a long traceback.
    raise ValueError("--dtype float16 is not supported on the CPU backend: pass --dtype bfloat16 or float32.")
  # A --set vocab_size is checked against the data (the corpus needs every id below it); without one,
  # a .bin corpus is sized from its tokens and text from its 256 byte values.
  corpus = load_corpus(cfg.data, vocab_size=cfg.model_overrides.get("vocab_size"), allow_binary=cfg.allow_binary)
  if corpus.vocab_size != model_cfg.vocab_size:
    model_cfg = model_cfg.replace(vocab_size=corpus.vocab_size)
  shortest = min(len(corpus.train), len(corpus.val))
  if shortest < cfg.seq_len + 2:
    raise ValueError(f"--seq-len {cfg.seq_len} is too long for the data: its train and validation splits hold "
                     f"{len(corpus.train)} and {len(corpus.val)} tokens, and each needs at least seq_len + 2; "
                     f"pass a shorter --seq-len or more data.")
  if cfg.upcycle_from is not None:
    _check_upcycle_source(cfg.upcycle_from, model_cfg)
    if "renormalize" not in cfg.model_overrides:
      # Renormalized weights sum to 1 over identical experts: the upcycled model is the dense one at step 0
      # (upcycle.py). A preset's top-1 default would scale each expert's output by its router probability.
      model_cfg = model_cfg.replace(renormalize=True)
  if cfg.mesh is not None:
    _check_mesh(cfg, model_cfg)
  _check_state_memory(cfg, model_cfg)
  resume_step = None
  # Whatever --ckpt-every says: a run already in --out is resumed (or refused), never trained over.
  if (out / "checkpoints").is_dir():
    ckpt = Checkpointer(out / "checkpoints")
    try:
      resume_step = ckpt.latest_step()
      if resume_step is not None:
        meta = ckpt.restore_meta()
        saved, now = TransformerConfig.identity(meta["model_config"]), TransformerConfig.identity(model_cfg.to_dict())
        if saved != now:
          raise ValueError(f"{cfg.out} holds a run of another model ({_config_diff(saved, now)}): "
                           f"resume it with the --preset, --dtype, --set and --data it was started with, or pass "
                           f"another --out.")
        if not _same_corpus(meta, corpus.name):
          raise ValueError(f"{cfg.out} holds a run on other data ({meta['corpus']!r} there, {corpus.name!r} now): "
                           f"resume it with the --data it was started with, or pass another --out.")
    finally:
      ckpt.close()
  return Plan(cfg, model_cfg, corpus, resume_step)


def train(cfg: TrainConfig, *, mesh=None) -> dict:
  """Train (or resume) a run; returns the final metrics (step, val_loss, val_bpb, tokens_per_s, ...).

  cfg.mesh: expert parallelism over a (data, expert) mesh. mesh: a plain data-parallel mesh (the
  "data" axis splits batches, params replicate); not both.
  """
  return run(prepare(cfg), mesh=mesh)


class StepDoesNotFit(RuntimeError):
  """The compiled training step needs more memory than its devices have free: raised before the first step,
  where running it would end in the allocator's error (and, over several GPUs, the others waiting forever)."""


def free_device_bytes(devices) -> int | None:
  """The least free memory over devices (the allocator's limit less what is in use); None where the backend
  does not say (the CPU)."""
  stats = [d.memory_stats() for d in devices]
  if not stats or not all(s and "bytes_limit" in s for s in stats):
    return None
  return min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)


def check_step_memory(compiled, devices, cfg: TrainConfig) -> None:
  """Raises StepDoesNotFit when the step's temp buffer and its new outputs (those not written over donated
  inputs) exceed the devices' free memory; its inputs are already in place, so they count as in use."""
  free = free_device_bytes(devices)
  try:
    analysis = compiled.memory_analysis() if free is not None else None
  except NotImplementedError:  # a backend without the analysis: the allocator will say it
    analysis = None
  if analysis is None:
    return
  need = analysis.temp_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
  if need > free:
    hint = ("; with --mesh, --ep-buffer-factor (e.g. 1.5) sizes the expert-parallel buffers at that many times "
            "the mean rows instead of the safe bound, which grows with the expert devices"
            if cfg.mesh is not None and cfg.ep_buffer_factor is None else "")
    remat = ("" if cfg.model_overrides.get("remat", "none") != "none"
             else ", --set remat=ffn (recompute the feed-forwards)")
    raise StepDoesNotFit(f"the training step needs {need / 2**30:.1f} GiB a device besides its inputs and "
                         f"{free / 2**30:.1f} GiB is free: pass a smaller --batch-size (or --grad-accum){remat}{hint}.")


def run(plan: Plan, *, mesh=None) -> dict:
  """The loop of a prepared run. Folders are created only once the step has compiled."""
  cfg, model_cfg, corpus = plan.cfg, plan.model_cfg, plan.corpus
  if cfg.mesh is not None and mesh is not None:
    raise ValueError("pass either TrainConfig.mesh (expert parallelism) or run(mesh=...) (data parallelism).")
  expert_mesh = mesh_from_config(cfg)
  mesh = expert_mesh if expert_mesh is not None else mesh
  out = pathlib.Path(cfg.out)
  resuming = plan.resume_step is not None
  ckpt = Checkpointer(out / "checkpoints", every=cfg.ckpt_every, keep=cfg.keep) if resuming else None
  model = (build_model(cfg, model_cfg, expert_mesh) if resuming
           else init_model(cfg, model_cfg, expert_mesh))
  apply, params = functional(model)
  tx = make_optimizer(cfg, loss_scaling=model_cfg.dtype == "float16")
  if expert_mesh is not None:
    params, opt_state, shardings = expert_parallel_state(model, params, tx, expert_mesh, model_cfg.num_experts)
  else:
    params, shardings = _shard(mesh, params, ()), None
    opt_state = tx.init(params)
  del model
  procs = dict(process_index=jax.process_index(), process_count=jax.process_count())
  main_process = procs["process_index"] == 0  # the one that logs; orbax coordinates the checkpoints
  stream = BatchStream(corpus.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed, **procs)
  step, elapsed = 0, 0.0
  if resuming:  # into this run's layout, whatever mesh the checkpoint was written from
    items, meta = ckpt.restore({"params": params, "opt_state": opt_state})
    params, opt_state = items["params"], items["opt_state"]
    step, elapsed = meta["step"], meta["elapsed_s"]
    stream.restore(meta["data"])
    if cfg.ckpt_every <= 0:  # --ckpt-every 0: resumed, but nothing saved (this Checkpointer would save every step)
      ckpt.close()
      ckpt = None
    if main_process:
      print(f"resumed from step {step} ({out / 'checkpoints'})", flush=True)
      if step >= cfg.steps:
        print(f"--steps {cfg.steps} is not above the checkpoint's step {step}, so nothing will be trained: "
              f"pass a larger --steps to train on.", flush=True)
      elif cfg.max_time_s is not None and elapsed >= cfg.max_time_s:  # the time counts across resumes
        print(f"--max-time-s {cfg.max_time_s:g} is spent (the run has trained {elapsed:.0f} s), so nothing will "
              f"be trained: pass a larger --max-time-s to train on.", flush=True)
  batch = lambda b: global_batch(mesh, b) if mesh is not None else b
  train_step, eval_step = make_steps(apply, tx, cfg.seed, shardings=shardings, with_copy=True,
                                     grad_accum=cfg.grad_accum)
  val = eval_batches(corpus.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches, **procs)
  tokens_per_step = cfg.batch_size * cfg.seq_len
  flops = model_cfg.flops_per_token(cfg.seq_len) * tokens_per_step
  # The devices this run computes on: the mesh's, or the one device jit uses without a mesh.
  num_devices = 1 if mesh is None else mesh.devices.size
  peak = peak_flops(jax.devices()[0].device_kind, num_devices, cfg.peak_flops)
  meta = lambda: {"step": step, "elapsed_s": elapsed, "data": stream.state(),
                  "model_config": model_cfg.to_dict(), "corpus": corpus.name,
                  "corpus_where": _corpus_where(corpus.name)}

  # Compile ahead of time so that every timed window (tokens/s, MFU, elapsed) is pure training.
  t0 = time.perf_counter()
  example = batch(stream.batch(stream.position))
  # The compute-dtype copy of the weights the forward casts (none for a float32 model): derived
  # from the params, so made here, after any restore, and never checkpointed.
  copy = compute_copy(params, cast_dtypes(apply, params, example[0], rng=jax.random.key(cfg.seed)))
  train_step = train_step.lower(params, opt_state, *example, jnp.int32(step), copy).compile()
  compile_s = time.perf_counter() - t0
  local = [d for d in (mesh.devices.flat if mesh is not None else jax.local_devices()[:1])
           if d.process_index == jax.process_index()]
  check_step_memory(train_step, local, cfg)
  if ckpt is None and cfg.ckpt_every > 0:
    ckpt = Checkpointer(out / "checkpoints", every=cfg.ckpt_every, keep=cfg.keep)
  log = MetricsLog(out / "metrics.jsonl") if main_process else MetricsLog.null()
  save = lambda force=False: ckpt and ckpt.save(step, {"params": params, "opt_state": opt_state}, meta(), force=force)

  def evaluate() -> dict:
    loss = float(np.mean([eval_step(params, *batch(b)) for b in val]))
    record = dict(step=step, elapsed_s=elapsed, val_loss=loss, val_bits_per_token=loss / math.log(2))
    if corpus.byte_level:
      record["val_bpb"] = record["val_bits_per_token"]
    log.write(kind="val", **record)
    return record

  unit = "byte" if corpus.byte_level else "token"  # a .bin corpus's tokens are not bytes
  bar = tqdm(total=cfg.steps, initial=step, disable=not (cfg.progress and main_process), dynamic_ncols=True)
  last = dict(step=step, elapsed_s=elapsed)
  window_t, window_steps, next_eval_s = time.perf_counter(), 0, elapsed + (cfg.eval_every_s or math.inf)
  # The time limits are read every step, not only on --log-every's synced steps (which a large --log-every would
  # make rare): the unsynced window runs ahead of the device by at most the few steps jax queues.
  training_s = lambda: elapsed + (time.perf_counter() - window_t)
  evaluated = None  # the last evaluation's record
  while step < cfg.steps and (cfg.max_time_s is None or training_s() < cfg.max_time_s):
    x, y = batch(next(stream))
    params, opt_state, m, copy = train_step(params, opt_state, x, y, jnp.int32(step), copy)
    step, window_steps = step + 1, window_steps + 1
    out_of_time = cfg.max_time_s is not None and training_s() >= cfg.max_time_s
    if step % cfg.log_every == 0 or step == cfg.steps or out_of_time:  # the last step is logged, however it ends
      m = jax.device_get(m)  # blocks: the window's time is then real compute time
      now = time.perf_counter()
      dt = now - window_t
      elapsed += dt
      tps = window_steps * tokens_per_step / dt
      run_mfu = mfu(flops, window_steps, dt, peak)
      last = dict(step=step, elapsed_s=elapsed, loss=float(m["loss"]), ce=float(m["ce"]),
                  aux_loss=float(m["aux_loss"]), lb_loss=float(m["lb_loss"]), z_loss=float(m["z_loss"]),
                  grad_norm=float(m["grad_norm"]), tokens_per_s=tps, mfu=run_mfu,
                  dropped_fraction=m["dropped_fraction"].tolist(),
                  tokens_per_expert=m["tokens_per_expert"].tolist())
      if cfg.mesh is not None:  # the logged step's assignments past the exchange's buffer, a layer: the fallback ran
        last["exchange_overflow"] = m["exchange_overflow"].tolist()
      if "loss_scale" in m:
        last["loss_scale"] = float(m["loss_scale"])
      log.write(kind="train", **last)
      bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{tps:,.0f}",
                      mfu="n/a" if run_mfu is None else f"{100 * run_mfu:.1f}%")
      window_t, window_steps = time.perf_counter(), 0
    bar.update(1)
    if step < cfg.steps and ((cfg.eval_every and step % cfg.eval_every == 0) or training_s() >= next_eval_s):
      t_eval = time.perf_counter()
      v = evaluated = evaluate()
      next_eval_s = training_s() + (cfg.eval_every_s or math.inf)
      if main_process:
        train_loss = f"train loss {last['loss']:.3f} | " if "loss" in last else ""  # none logged yet
        bar.write(f"step {step:>6} | {train_loss}"
                  f"val loss {v['val_loss']:.3f} | val bits/{unit} {v['val_bits_per_token']:.3f}")
      window_t += time.perf_counter() - t_eval  # eval time is not training time
    t_save = time.perf_counter()
    save()
    window_t += time.perf_counter() - t_save  # nor is checkpoint time
  bar.close()
  save(force=True)
  # A run stopped by --max-time-s right after an evaluation keeps that one (not a second, identical record).
  v = evaluated if evaluated is not None and evaluated["step"] == step else evaluate()
  final = {**last, **v, "compile_s": compile_s, "train_tokens": len(corpus.train)}
  if ckpt:
    ckpt.close()
  if main_process:
    train_loss = f"train loss {final['loss']:.3f}, " if "loss" in final else ""
    print(f"done: step {step}, {train_loss}"
          f"val loss {final['val_loss']:.3f}, val bits per {unit} {final['val_bits_per_token']:.3f} "
          f"({elapsed:.0f} s of training; metrics in {out / 'metrics.jsonl'})")
  return final


if __name__ == "__main__":
  main()
