"""Weak scaling of the MoE training step: one GPU against n GPUs with experts sharded over them.

The step is the library's own (sparsejax.train: init_model, make_optimizer, make_steps), at a fixed
batch per GPU: on one GPU without a mesh, on n GPUs with `--mesh data=1,expert=n` (what
`sparsejax-train --mesh` builds: the MoE layers expert-parallel, expert weights and their AdamW
moments sharded over "expert", the rest data-parallel), once per exchange ("ragged": only the
real rows cross, sent from P per-peer blocks, compact_send=False; "ragged_compact": the same from a
send buffer without the blocks' padding, ExpertParallelConfig.compact_send, the library's default
since 2026-11-27; "dense": the whole static buffer). With
--expert-groups G, n GPUs are also measured as the two-level mesh
`data=1,expert_group=G,expert=n/G` with the hierarchical (two-stage, dense) all-to-all, as
`sparsejax-train --mesh` runs it. --buffer-factors sizes each peer's exchange buffer
(ExpertParallelConfig.buffer_factor: "none" is the safe bound, f is f times the mean: each peer's block with
dispatch="assignments", the rows a receiver computes with dispatch="tokens"; a step that overflows it reruns the
exchange with the safe one). --dispatches measures each exchange with each ExpertParallelConfig.dispatch ("auto",
the library's default, is left out of the name). Each configuration's compiled memory a GPU is recorded (XLA's
temp buffer and the arguments); one whose temp buffer exceeds 70% of the GPUs' free memory is recorded as such
and not run (the safe buffers grow with the GPU count: top-8 on 4 GPUs asked for 82 GiB of temp, the allocation
failed, and the other GPUs waited for the first until the run was killed).

Timing: after --warmup steps, --steps steps back to back (as the training loop runs them), one
sync at the end; the median of --repeats such windows. Then --steps more are traced with
jax.profiler, and the device time of the collectives is read from the trace: the all-to-alls of
the MoE layers (and their count exchange) apart from the all-reduces of the data-parallel
gradients, and every op's device time by profile_step.py's categories (collectives apart), with the
ten costliest ops of "other", "gather/scatter" and "placement" and their HLO lines (top_ops: what
grows with the buffers). Shares are of the step time, per GPU (the mean over the n GPUs). CUDA graphs are off (as in
profile_step.py) unless --no-trace. Whether the exchange hides or waits: the all-to-all time during
which another kernel ran on the same GPU (overlapped_us), the GPUs' arrival skew at each all-to-all
(arrival_skew_us), and the busiest GPU's share of the last step's tokens (device_load); step 0's
loss is recorded too (the same initial params and batch in every config, so flags that change how
rows move can be checked against each other).

Efficiency(n) = tokens/s(n) / (n * tokens/s(1)). Writes experiments/results/ep_train_<gpu>_x<n>.json
and a markdown table (and copies under $OUT when set).

  python experiments/bench_ep_train.py                 # GPU machine with 2+ GPUs: xs-moe, 32 x 1024 per GPU
  python experiments/bench_ep_train.py --smoke         # CPU, 8 host devices, a tiny model
  python experiments/bench_ep_train.py --exchanges dense --token-chunks 1,2   # exchange/compute overlap
  python experiments/bench_ep_train.py --pretrain-steps 300 --tag _trained      # past the router's first steps
  python experiments/bench_ep_train.py --gpus 1,2,4 --exchanges dense --expert-groups 2   # and 4 GPUs as 2 x 2
  python experiments/bench_ep_train.py --gpus 1,4 --buffer-factors none,2      # the exchange buffer at 2x the mean
  python experiments/bench_ep_train.py --set token_rounding=true --tag _rounded   # token rounding over the exchange
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, as the device machines require
if "--smoke" in sys.argv:
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  os.environ["JAX_PLATFORMS"] = "cpu"
HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ep_balance import shard_load  # noqa: E402
from profile_step import CATEGORIES, load_trace, op_categories, op_times, stream_kernels  # noqa: E402
from sparsejax.cli import parse_overrides  # noqa: E402
from sparsejax.data import BatchStream, load_corpus  # noqa: E402
from sparsejax.parallel import DISPATCHES, ExpertParallelConfig  # noqa: E402
from sparsejax.train import (TrainConfig, cast_dtypes, compute_copy, expert_axes, expert_parallel_state,  # noqa: E402
                             free_device_bytes, functional, global_batch, init_model, make_optimizer, make_steps,
                             mesh_from_config)

EXCHANGES = ("ragged", "ragged_compact", "dense")
SMOKE_MODEL = dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, num_experts=8, moe_every=1, max_seq_len=32)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="xs-moe")
  p.add_argument("--batch-per-gpu", type=int, default=32)
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--gpus", default="", help="comma list of device counts (default: 1 and all)")
  p.add_argument("--exchanges", default="ragged,dense", help="comma list of " + ", ".join(EXCHANGES))
  p.add_argument("--buffer-factors", default="none",
                 help="comma list: each multi-GPU config with each exchange buffer "
                      "(none = the safe bound, or f x the mean)")
  p.add_argument("--expert-groups", default="",
                 help="comma list of G: each GPU count n > G that G divides is also run on the two-level mesh "
                      "(G groups of n/G) with the hierarchical exchange")
  p.add_argument("--dispatches", default="auto",
                 help="comma list of ExpertParallelConfig.dispatch (auto, assignments, tokens): each multi-GPU "
                      "exchange is measured with each")
  p.add_argument("--ragged-chunks", type=int, default=ExpertParallelConfig.ragged_chunks)
  p.add_argument("--token-chunks", default="1",
                 help="comma list: each multi-GPU exchange is measured with each (ExpertParallelConfig.token_chunks)")
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--pretrain-steps", type=int, default=0,
                 help="train this many steps on one device first; every config then starts from that state "
                      "(the router past its first steps' imbalance)")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
                 help="override a TransformerConfig field for every run, repeatable, as sparsejax-train --set "
                      "(e.g. --set token_rounding=true)")
  p.add_argument("--tag", default="", help="suffix of the result files' names")
  p.add_argument("--no-trace", action="store_true", help="skip the profile of the collectives")
  p.add_argument("--smoke", action="store_true", help="CPU, 8 host devices, a tiny model, few steps")
  p.add_argument("--out", default=str(HERE / "results"))
  a = p.parse_args(argv)
  if a.smoke:
    a.batch_per_gpu, a.seq_len, a.warmup, a.steps, a.repeats = 2, 32, 1, 2, 1
    a.pretrain_steps = min(a.pretrain_steps, 2)
  if a.pretrain_steps < 0:
    p.error(f"--pretrain-steps must be >= 0, got {a.pretrain_steps}")
  a.overrides = parse_overrides(a.overrides, p)
  bad = [e for e in a.exchanges.split(",") if e not in EXCHANGES]
  if bad:
    p.error(f"--exchanges takes a comma list of {', '.join(EXCHANGES)}; got {bad}")
  try:
    a.expert_groups = [int(g) for g in a.expert_groups.split(",") if g]
  except ValueError:
    p.error(f"--expert-groups takes a comma list of integers, got {a.expert_groups!r}")
  if any(g < 2 for g in a.expert_groups):
    p.error(f"--expert-groups: each group count must be >= 2, got {a.expert_groups}")
  try:
    a.buffer_factors = [None if f == "none" else float(f) for f in a.buffer_factors.split(",")]
  except ValueError:
    p.error(f"--buffer-factors takes 'none' or positive numbers, got {a.buffer_factors!r}")
  if any(f is not None and f <= 0 for f in a.buffer_factors):
    p.error(f"--buffer-factors takes 'none' or positive numbers, got {a.buffer_factors}")
  dispatches = a.dispatches.split(",")
  if any(d not in DISPATCHES for d in dispatches):
    p.error(f"--dispatches takes a comma list of {', '.join(DISPATCHES)}, got {a.dispatches!r}")
  return a


def collective_kind(event: dict) -> str | None:
  """'all-to-all' (the MoE exchange, its counts included), 'all-reduce' (gradients, stats), or None."""
  text = (event.get("args", {}).get("hlo_op", "") + " " + event["name"]).lower()
  if "all-to-all" in text or "alltoall" in text or "all_to_all" in text or "sendrecv" in text:
    return "all-to-all"
  if any(s in text for s in ("all-reduce", "allreduce", "reduce-scatter", "reducescatter", "all-gather",
                             "allgather")):
    return "all-reduce"
  if "nccl" in text:
    return "all-to-all" if "send" in text or "recv" in text else "all-reduce"
  return None


def overlapped_us(kernels: list[dict]) -> dict[str, float]:
  """Per collective kind, the device time during which another, non-collective kernel ran on the
  same device (another stream): sum over collective events c of |c ∩ union(compute on c's device)|.
  Zero means the exchange ran exposed, whatever the scheduler promised."""
  busy = collections.defaultdict(list)  # device -> merged [lo, hi) of compute kernels
  for e in kernels:
    if not collective_kind(e):
      iv, lo, hi = busy[e["pid"]], e["ts"], e["ts"] + e["dur"]
      if iv and lo <= iv[-1][1]:
        iv[-1][1] = max(iv[-1][1], hi)
      else:
        iv.append([lo, hi])
  out = collections.Counter()
  for e in kernels:
    kind = collective_kind(e)
    if kind:
      lo, hi = e["ts"], e["ts"] + e["dur"]
      out[kind] += sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in busy[e["pid"]] if a < hi and b > lo)
  return dict(out)


def arrival_skew_us(kernels: list[dict]) -> float:
  """Sum over the all-to-alls of (last device's start - first device's start): the time the devices
  that came first spent in the exchange waiting for the last (the i-th launch of an HLO op on each
  device is taken as the same collective)."""
  starts = collections.defaultdict(lambda: collections.defaultdict(list))  # op -> device -> starts
  for e in kernels:
    if collective_kind(e) == "all-to-all":
      starts[e.get("args", {}).get("hlo_op") or e["name"]][e["pid"]].append(e["ts"])
  total = 0.0
  for per_device in starts.values():
    if len(per_device) > 1:
      for ts in zip(*per_device.values()):
        total += max(ts) - min(ts)
  return total


def device_load(tokens_per_expert, n: int) -> dict | None:
  """Expert-parallel load balance from a step's tokens_per_expert [layers, E] (experts laid out in n
  contiguous shards): per layer max over devices of the shard's tokens / the mean; mean and worst.
  None when E is not a multiple of n (sliced experts: every device holds a part of each)."""
  load = shard_load(jax.device_get(tokens_per_expert), n)
  return None if load is None else {"mean": load[0], "max": load[1]}


def configs(counts, exchanges, groups) -> list[tuple[int, str | None, int | None]]:
  """(GPUs, exchange, expert groups) to measure: one GPU alone; n > 1 over one expert axis with each
  exchange, then as G groups of n / G (hierarchical, dense) for each G that divides n with n / G > 1."""
  out = []
  for n in counts:
    if n == 1:
      out.append((1, None, None))
      continue
    out += [(n, exchange, None) for exchange in exchanges]
    out += [(n, "dense", g) for g in groups if n % g == 0 and n // g > 1]
  return out


def mesh_spec(n: int, groups: int | None) -> str | None:
  """The --mesh of n GPUs: None for one, data=1,expert=n, or data=1,expert_group=G,expert=n/G."""
  if n == 1:
    return None
  return f"data=1,expert={n}" if groups is None else f"data=1,expert_group={groups},expert={n // groups}"


def build(args, corpus, n: int, exchange: str | None, chunks: int = 1, start=None, groups: int | None = None,
          buffer_factor: float | None = None, dispatch: str = "auto"):
  overrides = {**(SMOKE_MODEL if args.smoke else {}), **args.overrides}
  cfg = TrainConfig(preset=args.preset, batch_size=args.batch_per_gpu * n, seq_len=args.seq_len,
                    steps=10**6, model_overrides=overrides, mesh=mesh_spec(n, groups))
  model_cfg = cfg.model_config()
  if corpus.vocab_size != model_cfg.vocab_size:
    model_cfg = model_cfg.replace(vocab_size=corpus.vocab_size)
  mesh = mesh_from_config(cfg)
  two_level = {} if groups is None else dict(expert_axis=expert_axes(mesh), hierarchical=True)
  compact = exchange == "ragged_compact"  # "ragged" names the block send, as in the earlier tables
  parallel = None if exchange is None else ExpertParallelConfig(
      exchange="ragged" if compact else exchange, compact_send=compact, ragged_chunks=args.ragged_chunks,
      token_chunks=chunks, buffer_factor=buffer_factor, dispatch=dispatch, **two_level)
  model = init_model(cfg, model_cfg, mesh, parallel)
  apply, params = functional(model)
  tx = make_optimizer(cfg)
  if mesh is not None:
    params, opt_state, shardings = expert_parallel_state(model, params, tx, mesh, model_cfg.num_experts)
  else:
    opt_state, shardings = tx.init(params), None
  if start is not None:  # the pretrained (params, opt_state), laid out as this config's own
    params, opt_state = jax.device_put(start, shardings) if shardings else jax.device_put(start)
  train_step, _ = make_steps(apply, tx, cfg.seed, shardings=shardings, with_copy=True)
  # Batches the pretraining did not see (its stream has another seed).
  stream = BatchStream(corpus.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
  total = args.warmup + args.steps * (args.repeats + 1)
  put = (lambda b: global_batch(mesh, b)) if mesh is not None else jax.device_put
  batches = [put(next(stream)) for _ in range(total)]
  # As run() trains: the forward reads the compute-dtype copy of the weights that AdamW's update writes.
  copy = compute_copy(params, cast_dtypes(apply, params, batches[0][0], rng=jax.random.key(cfg.seed)))
  return cfg, model_cfg, train_step, (params, opt_state, copy), batches


def pretrain(args, corpus) -> tuple:
  """(params, opt_state) on the host after --pretrain-steps steps on one device, from the configs'
  common initial state, on batches of another seed than the measured ones."""
  cfg, _, train_step, (params, opt_state, copy), _ = build(
      argparse.Namespace(**{**vars(args), "warmup": 1, "steps": 0, "repeats": 0}), corpus, 1, None)
  stream = BatchStream(corpus.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
  m = None
  for i in range(args.pretrain_steps):
    params, opt_state, m, copy = train_step(params, opt_state, *map(jax.device_put, next(stream)), jnp.int32(i), copy)
  print(f"pretrained {args.pretrain_steps} steps on one device: loss {float(m['loss']):.3f}", flush=True)
  return jax.device_get((params, opt_state))


def compiled_memory(compiled) -> dict | None:
  """GiB a device: XLA's temp buffer (activations, exchange buffers) and the arguments (params, state, batch)."""
  try:
    m = compiled.memory_analysis()
    return {"temp": m.temp_size_in_bytes / 2**30, "arguments": m.argument_size_in_bytes / 2**30}
  except Exception:  # noqa: BLE001 - a backend without the analysis: the record leaves it out
    return None


def timed_windows(run, args) -> list[float]:
  """run(lo, hi) steps batches lo..hi-1 and syncs: step 0 alone, the rest of --warmup, then --repeats windows of
  --steps steps back to back; the seconds a step of each window."""
  run(0, 1)
  if args.warmup > 1:
    run(1, args.warmup)
  windows = []
  for r in range(args.repeats):
    lo = args.warmup + r * args.steps
    t = time.perf_counter()
    run(lo, lo + args.steps)
    windows.append((time.perf_counter() - t) / args.steps)
  return windows


def measure(args, corpus, n: int, exchange: str | None, chunks: int = 1, start=None, groups: int | None = None,
            buffer_factor: float | None = None, dispatch: str = "auto") -> dict:
  cfg, model_cfg, train_step, (params, opt_state, copy), batches = build(args, corpus, n, exchange, chunks, start,
                                                                         groups, buffer_factor, dispatch)
  first = args.pretrain_steps if start is not None else 0  # the step index the schedule sees
  t0 = time.perf_counter()
  compiled = train_step.lower(params, opt_state, *batches[0], jnp.int32(first), copy).compile()
  compile_s = time.perf_counter() - t0
  name = exchange or "none (one device)"
  if groups is not None:
    name = f"{exchange}, hierarchical {groups}x{n // groups}"
  if buffer_factor is not None:
    name += f", buffer {buffer_factor:g}x mean"
  if n > 1 and dispatch != "auto":
    name += f", dispatch {dispatch}"
  memory = compiled_memory(compiled)
  rec = {"gpus": n, "exchange": name, "expert_groups": groups, "buffer_factor": buffer_factor, "token_chunks": chunks,
         "dispatch": dispatch if n > 1 else None, "batch": cfg.batch_size, "seq_len": cfg.seq_len,
         "pretrain_steps": first, "compile_s": compile_s, "memory_gib": memory}
  print(f"compiled {name} on {n} GPUs in {compile_s:.0f} s; memory a GPU (GiB): {memory}", flush=True)
  free = free_device_bytes(jax.local_devices())
  free = None if free is None else free / 2**30
  # The arguments are on the GPUs already (in use); the temp buffer is one allocation, with a margin: the earlier
  # configurations fragment the allocator's free memory (82 GiB failed, and the other GPUs then waited forever).
  if memory is not None and free is not None and memory["temp"] > 0.7 * free:
    print(f"{name} on {n} GPUs needs {memory['temp']:.1f} GiB of temp a GPU, {free:.1f} free: not run", flush=True)
    return {**rec, "fits": False}
  state = [params, opt_state, copy]
  losses, last, overflow = [], {}, []

  def run(lo, hi):
    m = None
    for i in range(lo, hi):
      state[0], state[1], m, state[2] = compiled(state[0], state[1], *batches[i], jnp.int32(first + i), state[2])
      overflow.append(m["exchange_overflow"])  # read after the windows: a read here would sync every step
    jax.block_until_ready(state)
    losses.append(float(m["loss"]))
    last.update(m)

  # The first step's loss: the same params and batch in every config (flags, exchanges, chunks).
  windows = timed_windows(run, args)
  step_s = statistics.median(windows)
  rec.update({"fits": True, "step_ms": 1e3 * step_s, "windows_ms": [1e3 * w for w in windows],
              "tokens_per_s": cfg.batch_size * cfg.seq_len / step_s, "loss_first": losses[0], "loss_last": losses[-1],
              "finite": all(map(lambda v: v == v, losses)), "device_load": device_load(last["tokens_per_expert"], n),
              # steps (warm-up included) in which some assignment did not fit the exchange's buffer: the fallback ran
              "overflow_steps": [sum(int(o.sum()) > 0 for o in jax.device_get(overflow)), len(overflow)]})
  # Said before the trace, whose reading takes longest: a run stopped there still has the step's time.
  print(f"{name} on {n} GPUs: {rec['step_ms']:.2f} ms a step, busiest GPU / mean {rec['device_load']}, "
        f"{rec['overflow_steps'][0]} of {rec['overflow_steps'][1]} steps overflowed the exchange's buffer", flush=True)
  if not args.no_trace:
    lo = args.warmup + args.repeats * args.steps
    log_dir = tempfile.mkdtemp(prefix="ep_train_")
    try:
      with jax.profiler.trace(log_dir):
        run(lo, lo + args.steps)
      trace = load_trace(log_dir)
    finally:
      shutil.rmtree(log_dir, ignore_errors=True)
    kernels = stream_kernels(trace)
    hlo = compiled.as_text()
    module = hlo.split("HloModule", 1)[1].split()[0].rstrip(",")
    cats = op_categories(hlo)
    times, unattributed = op_times(trace, module)
    per_gpu_step_ms = lambda us: us / 1e3 / args.steps / n
    # The collectives apart, whatever scope they were issued in.
    cat_of = {op: "collectives" if collective_kind({"name": op, "args": {"hlo_op": op}}) else cats.get(op, "other")
              for op in times}
    by_cat = collections.Counter()
    for op, us in times.items():
      by_cat[cat_of[op]] += us
    by_cat["other"] += unattributed
    rec["categories_ms"] = {c: per_gpu_step_ms(by_cat[c]) for c in (*CATEGORIES, "collectives") if by_cat[c]}
    rec["unattributed_ms"] = per_gpu_step_ms(unattributed)
    # The ops behind the categories that grow with the exchange's buffers, with their HLO lines (shapes).
    ranked = sorted(times.items(), key=lambda kv: -kv[1])
    rec["top_ops"] = top_ops([(op, per_gpu_step_ms(us)) for op, us in ranked], cat_of, hlo,
                             ("other", "gather/scatter", "placement"))
    by_kind, names = collections.Counter(), collections.Counter()
    for e in kernels:
      kind = collective_kind(e)
      if kind:
        by_kind[kind] += e["dur"]
        names[(kind, (e.get("args", {}).get("hlo_op") or e["name"])[:60])] += e["dur"]
    rec["collectives_ms"] = {k: per_gpu_step_ms(v) for k, v in by_kind.items()}
    rec["collective_share"] = {k: per_gpu_step_ms(v) / rec["step_ms"] for k, v in by_kind.items()}
    rec["collectives_overlapped_ms"] = {k: per_gpu_step_ms(v) for k, v in overlapped_us(kernels).items()}
    rec["all_to_all_arrival_skew_ms"] = arrival_skew_us(kernels) / 1e3 / args.steps
    rec["top_collectives"] = [(k, name, per_gpu_step_ms(us)) for (k, name), us in names.most_common(8)]
  return rec


def hlo_line(hlo: str, op: str, width: int = 240) -> str:
  """The instruction that defines `op` in the module's text (its shape and operands), cut to width."""
  m = re.search(rf"^\s*(?:ROOT )?%?{re.escape(op)} = .*$", hlo, re.M)
  return m.group(0).strip()[:width] if m else ""


def top_ops(ranked: list, cat_of: dict, hlo: str, categories, n: int = 10) -> dict:
  """The n costliest ops of each category with their HLO lines. Only those n are looked up: a 4-GPU top-8 step's
  module is large enough that a search for every op took minutes."""
  return {c: [(op, t, hlo_line(hlo, op)) for op, t in [(op, t) for op, t in ranked if cat_of[op] == c][:n]]
          for c in categories}


def markdown(report: dict) -> str:
  # A smoke run's model is SMOKE_MODEL, not the preset's: its title says so, as the other benchmarks mark theirs.
  model = (f"smoke run: {report['preset']} shrunk to " + ", ".join(f"{k}={v}" for k, v in SMOKE_MODEL.items())
           if report.get("smoke") else report["preset"])
  lines = [f"### MoE training step, weak scaling ({model}, {report['batch_per_gpu']} x "
           f"{report['seq_len']} tokens per GPU, {report['device_kind']}, jax {report['jax']}"
           + (f", from the state after {report['pretrain_steps']} steps on one device" if report.get("pretrain_steps") else "")
           + "".join(f", {k}={v}" for k, v in report.get("model_overrides", {}).items())
           + (f", XLA_FLAGS={report['xla_flags']}" if report.get("xla_flags") else "") + ")", "",
           "| GPUs | exchange | token chunks | step ms | tokens/s | weak-scaling eff. | all-to-all ms (share) | "
           "all-to-all ms under compute | all-reduce ms (share) | memory GiB (temp + arguments) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  mem = lambda r: f"{r['memory_gib']['temp']:.2f} + {r['memory_gib']['arguments']:.2f}" if r.get("memory_gib") else ""
  for r in report["runs"]:
    if r.get("fits") is False:
      lines.append(f"| {r['gpus']} | {r['exchange']} | {r.get('token_chunks', 1)} | does not fit the GPU: not run "
                   "| | | | | | " + mem(r) + " |")
      continue
    c, s = r.get("collectives_ms", {}), r.get("collective_share", {})
    cell = lambda k: f"{c[k]:.2f} ({100 * s[k]:.1f}%)" if k in c else ("0" if "collectives_ms" in r else "")
    hidden = f"{r['collectives_overlapped_ms'].get('all-to-all', 0.0):.2f}" if "collectives_overlapped_ms" in r else ""
    eff = r["weak_scaling_efficiency"]
    lines.append(f"| {r['gpus']} | {r['exchange']} | {r.get('token_chunks', 1)} | {r['step_ms']:.2f} | {r['tokens_per_s']:.3g} | "
                 f"{'' if eff is None else f'{100 * eff:.1f}%'} | {cell('all-to-all')} | {hidden} | {cell('all-reduce')} | "
                 f"{mem(r)} |")
  ran = [r for r in report["runs"] if r.get("fits") is not False]
  if any("device_load" in r for r in ran):
    lines += ["", "Balance: tokens on the busiest GPU over the mean (last step, mean / worst over MoE layers), and the "
              "all-to-alls' arrival skew (last GPU's start minus first's, summed per step):", "",
              "| GPUs | exchange | token chunks | busiest / mean | arrival skew ms |", "|---|---|---|---|---|"]
    for r in ran:
      load, skew = r.get("device_load"), r.get("all_to_all_arrival_skew_ms")
      load_cell = "" if load is None else f"{load['mean']:.3f} / {load['max']:.3f}"
      skew_cell = "" if skew is None else f"{skew:.2f}"
      lines.append(f"| {r['gpus']} | {r['exchange']} | {r.get('token_chunks', 1)} | {load_cell} | {skew_cell} |")
  names = [c for c in (*CATEGORIES, "collectives") if any(c in r.get("categories_ms", {}) for r in ran)]
  if names:
    lines += ["", "Device time per step and GPU, by category (ms; profile_step.py's categories, the "
              "collectives apart):", "",
              "| GPUs | exchange | token chunks | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for r in ran:
      c = r.get("categories_ms", {})
      lines.append(f"| {r['gpus']} | {r['exchange']} | {r.get('token_chunks', 1)} | " + " | ".join(f"{c.get(n, 0.0):.2f}" for n in names) + " |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  args = parse_args(argv)
  if not args.no_trace and "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    # As profile_step.py: without CUDA graphs every kernel in the trace carries its HLO op (so the
    # categories can be read); set before the backend starts, for timing and trace alike.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
  ndev = len(jax.devices())
  counts = [int(c) for c in args.gpus.split(",")] if args.gpus else sorted({1, ndev})
  corpus = load_corpus(None)
  kind = jax.devices()[0].device_kind
  report = {"preset": args.preset, "smoke": args.smoke, "batch_per_gpu": args.batch_per_gpu, "seq_len": args.seq_len,
            "device_kind": kind, "jax": jax.__version__, "pretrain_steps": args.pretrain_steps,
            "model_overrides": args.overrides,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "runs": []}
  start = pretrain(args, corpus) if args.pretrain_steps else None
  for n, exchange, groups in configs(counts, args.exchanges.split(","), args.expert_groups):
    for chunks in ([1] if n == 1 else [int(c) for c in args.token_chunks.split(",")]):
      for factor in ([None] if n == 1 else args.buffer_factors):
        for dispatch in (["auto"] if n == 1 else args.dispatches.split(",")):
          rec = measure(args, corpus, n, exchange, chunks, start, groups, factor, dispatch)
          report["runs"].append(rec)
          print(json.dumps(rec), flush=True)
  base = next((r for r in report["runs"] if r["gpus"] == 1), None)
  for r in report["runs"]:
    r["weak_scaling_efficiency"] = (r["tokens_per_s"] / (r["gpus"] * base["tokens_per_s"])
                                    if base and "tokens_per_s" in r and "tokens_per_s" in base else None)
  table = markdown(report)
  print("\n" + table)
  name = ("cpu_smoke" if args.smoke else kind.lower().replace("nvidia ", "").replace(" ", "_")) + f"_x{max(counts)}" + args.tag
  dirs = [pathlib.Path(args.out)] + ([pathlib.Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
  for d in dirs:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"ep_train_{name}.json").write_text(json.dumps(report, indent=1))
    (d / f"ep_train_{name}.md").write_text(table + "\n")
  return report


if __name__ == "__main__":
  main()
