"""Train a Transformer LM: `sparsejax-train --preset tiny` (see `--help`), or train(TrainConfig(...)).

The loop: data -> jitted step (AdamW, warm-up + cosine, clipping, aux losses) -> log -> checkpoint.
Runs resume exactly from the latest finished checkpoint in `out/checkpoints` (params, optimizer,
data position and step; the step's rng is fold_in(seed, step)), so a killed run restarted with
the same command continues the same loss curve.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from sparsejax.checkpoint import Checkpointer
from sparsejax.data import BatchStream, eval_batches, load_corpus
from sparsejax.models import Transformer, TransformerConfig, cross_entropy, get_preset

# optax.global_norm is deprecated in newer optax; older ones lack optax.tree.norm.
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm

# Dense bf16 peak FLOP/s per chip, for MFU. Unknown devices (e.g. CPUs) report no MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12,
              "L4": 121e12, "TPU v4": 275e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a run needs; model_overrides replace fields of the preset's TransformerConfig."""
  preset: str = "tiny"
  data: str | None = None          # None: the Python standard library's sources
  out: str = "runs/tiny"
  steps: int = 300
  batch_size: int = 16
  seq_len: int = 128
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup: int = 30
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  seed: int = 0
  dtype: str | None = None         # compute dtype; None: bfloat16 on GPU/TPU, float32 on CPU
  eval_every: int = 100
  eval_every_s: float | None = None  # also evaluate every this many seconds of training time
  eval_batches: int = 8
  ckpt_every: int = 100            # 0: no checkpoints at all (e.g. timing experiments)
  keep: int = 3
  log_every: int = 10
  max_time_s: float | None = None  # stop after this much training time (compile and eval excluded)
  upcycle_from: str | None = None  # a dense run's out dir (or checkpoint dir): preset must be its MoE twin
  peak_flops: float | None = None
  progress: bool = True
  model_overrides: dict = dataclasses.field(default_factory=dict)

  def model_config(self) -> TransformerConfig:
    dtype = self.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    over = {"dtype": dtype, **self.model_overrides}
    cfg = get_preset(self.preset, **over)
    if self.seq_len > cfg.max_seq_len:
      cfg = cfg.replace(max_seq_len=self.seq_len)
    return cfg


def functional(model: nnx.Module) -> tuple[Callable, dict]:
  """(apply, params): apply(params, *args, **kw) = model(*args, **kw) with params a pure dict of arrays."""
  graphdef, state = nnx.split(model)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)

  def apply(params, *args, **kwargs):
    s = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(s, params)
    return nnx.merge(graphdef, s)(*args, **kwargs)

  return apply, nnx.to_pure_dict(state)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """clip(g, grad_clip) -> AdamW(b2=0.95) with lr: linear warm-up, cosine decay to min_lr_ratio * lr.

  Weight decay skips vectors (norm scales): decaying them only shrinks the residual stream.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, max(1, cfg.warmup), max(cfg.steps, cfg.warmup + 1), cfg.lr * cfg.min_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask))


def make_steps(apply: Callable, tx: optax.GradientTransformation, seed: int):
  """train_step(params, opt, x, y, step) -> (params, opt, metrics); eval_step(params, x, y) -> loss."""

  def loss_fn(params, x, y, rng):
    logits, stats = apply(params, x, rng=rng)
    ce = cross_entropy(logits, y)
    return ce + stats.aux_loss, (ce, stats)

  def train_step(params, opt_state, x, y, step):
    rng = jax.random.fold_in(jax.random.key(seed), step)
    (loss, (ce, stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y, rng)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(loss=loss, ce=ce, aux_loss=stats.aux_loss, lb_loss=stats.load_balancing_loss,
                   z_loss=stats.router_z_loss, grad_norm=_global_norm(grads),
                   tokens_per_expert=stats.tokens_per_expert, dropped_fraction=stats.dropped_fraction)
    return params, opt_state, metrics

  def eval_step(params, x, y):
    return cross_entropy(apply(params, x)[0], y)

  return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(eval_step)


def peak_flops(cfg: TrainConfig) -> float | None:
  if cfg.peak_flops:
    return cfg.peak_flops
  kind = jax.devices()[0].device_kind
  return next((v * jax.device_count() for k, v in PEAK_FLOPS.items() if k.lower() in kind.lower()), None)


def init_model(cfg: TrainConfig, model_cfg: TransformerConfig):
  """A fresh model, or the sparse upcycling of a dense checkpoint when cfg.upcycle_from is set."""
  if cfg.upcycle_from is None:
    return Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed))
  from sparsejax.upcycle import load_dense_and_upcycle
  return load_dense_and_upcycle(cfg.upcycle_from, model_cfg, seed=cfg.seed)


def _shard(mesh, tree, spec):
  """The multi-device hook: with a mesh (Auto axes), batches split over its "data" axis, params replicate.

  The expert-parallel layer will replace the params' placement by its logical-axis rules.
  """
  if mesh is None:
    return tree
  from jax.sharding import NamedSharding, PartitionSpec
  return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(*spec)))


class MetricsLog:
  """Appends one JSON object per line; after a resume, readers keep the last record of each step."""

  def __init__(self, path: pathlib.Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    self.file = open(path, "a")

  def write(self, **record: Any) -> None:
    self.file.write(json.dumps(record) + "\n")
    self.file.flush()


def train(cfg: TrainConfig, *, mesh=None) -> dict:
  """Train (or resume) a run; returns the final metrics (step, val_loss, val_bpb, tokens_per_s, ...)."""
  out = pathlib.Path(cfg.out)
  model_cfg = cfg.model_config()
  corpus = load_corpus(cfg.data, vocab_size=cfg.model_overrides.get("vocab_size"))  # .bin: from its tokens
  if corpus.vocab_size != model_cfg.vocab_size:
    model_cfg = model_cfg.replace(vocab_size=corpus.vocab_size)
  ckpt = Checkpointer(out / "checkpoints", every=cfg.ckpt_every, keep=cfg.keep) if cfg.ckpt_every > 0 else None
  resuming = ckpt is not None and ckpt.latest_step() is not None
  model = Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed)) if resuming else init_model(cfg, model_cfg)
  apply, params = functional(model)
  tx = make_optimizer(cfg)
  opt_state = tx.init(params)
  stream = BatchStream(corpus.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
  step, elapsed = 0, 0.0
  if resuming:
    saved_cfg = ckpt.restore_meta()["model_config"]
    if saved_cfg != model_cfg.to_dict():
      raise ValueError(f"{out} holds a run of another model config ({saved_cfg}); use another --out.")
    items, meta = ckpt.restore({"params": params, "opt_state": opt_state})
    params, opt_state = items["params"], items["opt_state"]
    step, elapsed = meta["step"], meta["elapsed_s"]
    stream.restore(meta["data"])
  params, opt_state = _shard(mesh, params, ()), _shard(mesh, opt_state, ())
  train_step, eval_step = make_steps(apply, tx, cfg.seed)
  val = eval_batches(corpus.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
  log = MetricsLog(out / "metrics.jsonl")
  tokens_per_step = cfg.batch_size * cfg.seq_len
  flops, peak = model_cfg.flops_per_token(cfg.seq_len) * tokens_per_step, peak_flops(cfg)
  meta = lambda: {"step": step, "elapsed_s": elapsed, "data": stream.state(),
                  "model_config": model_cfg.to_dict(), "corpus": corpus.name}
  save = lambda force=False: ckpt and ckpt.save(step, {"params": params, "opt_state": opt_state}, meta(), force=force)

  def evaluate() -> dict:
    loss = float(np.mean([eval_step(params, *_shard(mesh, b, ("data",))) for b in val]))
    record = dict(step=step, elapsed_s=elapsed, val_loss=loss, val_bits_per_token=loss / math.log(2))
    if corpus.byte_level:
      record["val_bpb"] = record["val_bits_per_token"]
    log.write(kind="val", **record)
    return record

  # Compile ahead of time so that every timed window (tokens/s, MFU, elapsed) is pure training.
  t0 = time.perf_counter()
  example = _shard(mesh, stream.batch(stream.position), ("data",))
  train_step = train_step.lower(params, opt_state, *example, jnp.int32(step)).compile()
  compile_s = time.perf_counter() - t0
  bar = tqdm(total=cfg.steps, initial=step, disable=not cfg.progress, dynamic_ncols=True)
  last = dict(step=step, elapsed_s=elapsed)
  window_t, window_steps, next_eval_s = time.perf_counter(), 0, elapsed + (cfg.eval_every_s or math.inf)
  while step < cfg.steps and (cfg.max_time_s is None or elapsed < cfg.max_time_s):
    x, y = _shard(mesh, next(stream), ("data",))
    params, opt_state, m = train_step(params, opt_state, x, y, jnp.int32(step))
    step, window_steps = step + 1, window_steps + 1
    if step % cfg.log_every == 0 or step == cfg.steps:
      m = jax.device_get(m)  # blocks: the window's time is then real compute time
      now = time.perf_counter()
      dt = now - window_t
      elapsed += dt
      tps = window_steps * tokens_per_step / dt
      mfu = window_steps * flops / dt / peak if peak else None
      last = dict(step=step, elapsed_s=elapsed, loss=float(m["loss"]), ce=float(m["ce"]),
                  aux_loss=float(m["aux_loss"]), lb_loss=float(m["lb_loss"]), z_loss=float(m["z_loss"]),
                  grad_norm=float(m["grad_norm"]), tokens_per_s=tps, mfu=mfu,
                  dropped_fraction=m["dropped_fraction"].tolist(),
                  tokens_per_expert=m["tokens_per_expert"].tolist())
      log.write(kind="train", **last)
      bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{tps:,.0f}",
                      mfu="n/a" if mfu is None else f"{100 * mfu:.1f}%")
      window_t, window_steps = time.perf_counter(), 0
    bar.update(1)
    if step < cfg.steps and ((cfg.eval_every and step % cfg.eval_every == 0) or elapsed >= next_eval_s):
      t_eval = time.perf_counter()
      v = evaluate()
      next_eval_s = elapsed + (cfg.eval_every_s or math.inf)
      bar.write(f"step {step:>6} | train loss {last.get('loss', float('nan')):.3f} | "
                f"val loss {v['val_loss']:.3f} | val bits/byte {v['val_bits_per_token']:.3f}")
      window_t += time.perf_counter() - t_eval  # eval time is not training time
    t_save = time.perf_counter()
    save()
    window_t += time.perf_counter() - t_save  # nor is checkpoint time
  bar.close()
  save(force=True)
  final = {**last, **evaluate(), "compile_s": compile_s}
  if ckpt:
    ckpt.close()
  print(f"done: step {step}, train loss {final.get('loss', float('nan')):.3f}, "
        f"val loss {final['val_loss']:.3f}, val bits per byte {final['val_bits_per_token']:.3f} "
        f"({elapsed:.0f} s of training; metrics in {out / 'metrics.jsonl'})")
  return final


def _parse_value(text: str) -> Any:
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text  # a bare string such as bfloat16


def parse_args(argv=None) -> TrainConfig:
  from sparsejax.models import PRESETS
  p = argparse.ArgumentParser(prog="sparsejax-train", description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  d = TrainConfig()
  helps = {"preset": f"one of {', '.join(sorted(PRESETS))}",
           "data": "text file, folder of text files, uint16 .bin, or stdlib (default: the Python stdlib)",
           "out": "run directory: metrics.jsonl and checkpoints/; an existing run there is resumed",
           "dtype": "compute dtype (float32, bfloat16); default bfloat16 on accelerators, float32 on CPU",
           "max_time_s": "stop after this many seconds of training (compile/eval excluded)",
           "ckpt_every": "checkpoint interval in steps; 0 disables checkpoints",
           "upcycle_from": "a dense run directory to sparse-upcycle into --preset (an MoE preset)",
           "peak_flops": "peak FLOP/s for MFU (default: looked up from the device kind)"}
  for f in dataclasses.fields(TrainConfig):
    if f.name in ("model_overrides", "progress"):
      continue
    kind = {"int": int, "float": float}.get(str(f.type).split("|")[0].strip(), str)  # "float | None" -> float
    p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=getattr(d, f.name),
                   help=helps.get(f.name, " "))
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="override a TransformerConfig field, e.g. --set capacity_factor=1.25")
  p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
  a = p.parse_args(argv)
  overrides = {}
  for item in a.set:
    name, sep, value = item.partition("=")
    if not sep or name not in {f.name for f in dataclasses.fields(TransformerConfig)}:
      p.error(f"--set {item!r}: expected FIELD=VALUE with FIELD a TransformerConfig field.")
    overrides[name] = _parse_value(value)
  fields = {f.name for f in dataclasses.fields(TrainConfig)} & set(vars(a))
  return TrainConfig(**{k: getattr(a, k) for k in fields}, model_overrides=overrides,
                     progress=not a.no_progress)


def main(argv=None) -> None:
  train(parse_args(argv))


if __name__ == "__main__":
  main()
