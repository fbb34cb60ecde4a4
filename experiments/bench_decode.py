"""Decode speed of the dense and MoE presets against the memory bound, bf16 vs int8 experts (one GPU).

For each preset and batch size: build the model (random weights), check the cached decode step
against the full forward (and int8 against bf16), then time decoding with warm-up and medians: the
device loop (Decoder.run: `steps` steps in one jitted call, the step time its time / steps) and, for
comparison, host-driven steps (one jitted call per token from Python). The bound is the bytes one step must read at the card's copy bandwidth, measured here with a
large device-to-device copy: the weights of the experts the step's tokens chose (distinct, per MoE
layer), every other weight (the embedding only as the rows looked up), and the filled KV cache.
Writes experiments/results/decode_<device>.{json,md,png} (and copies them to $OUT when set).

  python experiments/bench_decode.py                      # xs, small, medium; batch 1 and 32
  python experiments/bench_decode.py --presets medium-moe --batches 1
  python experiments/bench_decode.py --smoke              # tiny presets, any backend, a few steps
  python experiments/bench_decode.py --presets medium-moe --batches 1 --no-check   # timing only
  python experiments/bench_decode.py --presets medium-moe --label mixtral-8L \
      --set d_model=4096,num_heads=32,d_ff=14336,num_experts=8,top_k=2,glu=true,activation=silu,num_layers=8
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsejax.inference import Decoder, Sampling, quantize_model  # noqa: E402
from sparsejax.inference.generate import DECODE_CHUNK  # noqa: E402
from sparsejax.inference.decode_moe import SMALL_BATCH_MAX_ASSIGNMENTS  # noqa: E402
from sparsejax.modules import MoE  # noqa: E402
from sparsejax.models import Transformer, get_preset  # noqa: E402
from provenance import source_fingerprint  # noqa: E402
from out_dir import copy_to_out  # noqa: E402

PRESETS = ["xs-dense", "xs-moe", "small-dense", "small-moe", "medium-dense", "medium-moe"]
EXPERT_WEIGHTS = ("w_in", "w_gate", "w_out")
LAYER_RUN = 24  # kernels of --trace's run from the middle of a step: more than one medium-MoE layer's


def log(*a, **kw):
  print(*a, flush=True, **kw)


def copy_bandwidth(nbytes: int, warmup_s: float = 1.0, windows: int = 10, calls: int = 10,
                   clock=time.perf_counter) -> float:
  """Bytes/s of a device-to-device copy (read + write counted): y = x + 1 over a float32 buffer, as the
  median over `windows` windows of `calls` back-to-back calls, each window synced once, after `warmup_s`
  of such calls. Timed one synced call at a time, each 1.5 ms copy of the default 2 GiB also paid the
  host's dispatch and sync: that read 2,363-2,743 GB/s across runs on one kind of H100, and 2,526-2,550
  against this timer's 2,938-2,948 in one process (results/copy_bandwidth_warmup_H100.log)."""
  x = jax.random.uniform(jax.random.key(0), (nbytes // 4,), jnp.float32, 1.0, 2.0)
  f = jax.jit(lambda x: x + 1.0)
  y = f(x).block_until_ready()
  assert bool(jnp.all(y > 1.5)), "copy check failed"
  t0 = clock()
  while clock() - t0 < warmup_s:
    f(x).block_until_ready()
  times = []
  for _ in range(windows):
    t0 = clock()
    for _ in range(calls):
      y = f(x)
    y.block_until_ready()
    times.append((clock() - t0) / calls)
  return 2 * nbytes / statistics.median(times)


def _bytes(a) -> int:
  return a.size * a.dtype.itemsize


def step_bytes(model: Transformer, batch: int, kv_slots: float, distinct: np.ndarray) -> dict:
  """What one decode step of `batch` rows must read: chosen experts, other weights, the KV cache."""
  cfg = model.cfg
  moes = [m for _, m in nnx.iter_modules(model) if isinstance(m, MoE)]
  per_expert = []
  for m in moes:
    arrays = [getattr(m, a, None) for n in EXPERT_WEIGHTS for a in (n, f"{n}_scale")]
    per_expert.append(sum(_bytes(p[...]) for p in arrays if p is not None) / m.config.num_experts)
  expert_total = sum(pe * m.config.num_experts for pe, m in zip(per_expert, moes))
  all_params = sum(_bytes(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  embed = _bytes(model.embed[...])
  other = all_params - expert_total - embed + batch * embed // cfg.vocab_size
  experts = float(sum(pe * d for pe, d in zip(per_expert, distinct)))
  itemsize = jnp.dtype(cfg.compute_dtype).itemsize
  kv = 2 * cfg.num_layers * batch * kv_slots * cfg.d_model * itemsize
  return dict(experts=experts, other=float(other), kv=float(kv), total=experts + other + kv,
              all_experts=float(expert_total))


def check_step(model, prompt) -> tuple[float, np.ndarray]:
  """(relative error of the cached step's logits against the full forward, those logits)."""
  b, p = prompt.shape
  m = nnx.merge(*nnx.split(model))
  m.init_cache(b, p)
  graphdef, cache, params = nnx.split(m, nnx.Cache, ...)

  @jax.jit
  def cached(params, cache):
    mm = nnx.merge(graphdef, params, cache)
    mm(prompt[:, :-1], decode=True)  # prefill
    return mm(prompt[:, -1:], decode=True)[0][:, -1]  # one step through the small-batch path

  got = np.asarray(cached(params, cache), np.float32)
  want = np.asarray(nnx.jit(lambda m, t: m(t)[0][:, -1])(model, prompt), np.float32)
  assert np.all(np.isfinite(got)), "non-finite logits from the decode step"
  return float(np.linalg.norm(got - want) / np.linalg.norm(want)), got


def trace_loop(dec, tok, steps: int) -> tuple[dict, jax.Array]:
  """Kernel time per step of one device-loop call of `steps` steps under jax.profiler, by kernel kind
  (profile_step.kernel_table's fields, divided by `steps`), and "run": LAYER_RUN consecutive kernels from
  the middle of the last step, each as (kind, idle us since the kernel before it, us). Kernels show one by
  one only with XLA's command buffers off (XLA_FLAGS=--xla_gpu_enable_command_buffer=)."""
  import tempfile
  from profile_step import kernel_kind, kernel_table, load_trace, stream_kernels
  log_dir = tempfile.mkdtemp(prefix="decode_trace_")
  with jax.profiler.trace(log_dir):
    buf, tok = dec.run_buffer(tok, steps)
    tok.block_until_ready()
  trace = load_trace(log_dir)
  table = kernel_table(trace, steps, top=LAYER_RUN, by_kind=True)
  kernels = stream_kernels(trace)
  last = kernels[-(len(kernels) // steps):]
  run = last[max(len(last) // 2 - 1, 0):][:LAYER_RUN + 1]  # and the kernel before the first, for its gap
  table["run"] = [(kernel_kind(e), e["ts"] - (p["ts"] + p["dur"]), e["dur"]) for p, e in zip(run, run[1:])]
  shutil.rmtree(log_dir, ignore_errors=True)
  return table, tok


def kernel_lines(k: dict) -> list[str]:
  """trace_loop's table as text: kernel time per step by kind, then the run of the last step's kernels."""
  lines = [f"  kernels: union busy {k['busy_union_ms']:.3f} ms / step; " + "; ".join(
      f"{name} {ms:.3f} ms x{n:.0f}" for name, ms, n in k["kernels"])]
  if k.get("run"):
    lines.append("  a run of the last step's kernels (idle us before, us): " + "; ".join(
        f"{name} {gap:.1f} {us:.1f}" for name, gap, us in k["run"]))
  return lines


def decode_slots(prompt_len: int, warmup: int, steps: int, reps: int) -> int:
  """Cache slots time_decode fills: prefill, the host-driven steps (first, warm-up, reps x steps,
  steps synced, steps compared with the loop and rewound), then the device loop (one warm-up call,
  reps calls, one traced call) of `steps` each."""
  return prompt_len + 1 + warmup + reps * steps + 2 * steps + (reps + 2) * steps


def time_decode(model, batch: int, prompt_len: int, warmup: int, steps: int, reps: int, seed: int,
                trace: bool = False, chunk: int = DECODE_CHUNK) -> dict:
  """Median ms of one decode step: the device loop (one call of `steps` steps, / steps), and host-driven
  steps pipelined (reps x steps back to back) and synced (one at a time). loop_tokens_differ: the
  fraction of greedy tokens that the loop and host-driven steps from the same cache pick differently
  (0 on the CPU; on a GPU the loop's body may fuse differently, and a near-tie may flip)."""
  dec = Decoder(model, batch, decode_slots(prompt_len, warmup, steps, reps), Sampling(0.0), chunk=chunk)
  prompt = jax.random.randint(jax.random.key(seed), (batch, prompt_len), 1, model.cfg.vocab_size)
  t0 = time.perf_counter()
  tok = dec(prompt).block_until_ready()
  prefill_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  tok = dec(tok[:, None]).block_until_ready()  # compiles the step
  compile_s = time.perf_counter() - t0
  # Where a row's minutes go, printed as they pass: a row cut off by a time limit prints nothing else.
  log(f"  batch {batch}: prefill {prefill_s:.1f} s (its compile included), step compile {compile_s:.1f} s")
  for _ in range(warmup):
    tok = dec(tok[:, None])
  tok.block_until_ready()
  host = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(steps):
      tok = dec(tok[:, None])
    tok.block_until_ready()
    host.append((time.perf_counter() - t0) / steps)
  synced = []
  for _ in range(steps):
    t0 = time.perf_counter()
    tok = dec(tok[:, None]).block_until_ready()
    synced.append(time.perf_counter() - t0)
  # The loop and `steps` host-driven steps from the same cache: do they pick the same tokens?
  saved = ([jnp.copy(c) for c in dec.cache], dec.steps, dec.position)
  host_tokens = [tok]
  for _ in range(steps):
    host_tokens.append(dec(host_tokens[-1][:, None]))
  dec.cache, dec.steps, dec.position = saved
  t0 = time.perf_counter()
  buf, tok = dec.run_buffer(tok, steps)  # compiles the loop (once for every n)
  tok.block_until_ready()
  loop_compile_s = time.perf_counter() - t0
  log(f"  batch {batch}: device loop compiled in {loop_compile_s:.1f} s")
  loop_vs_host = float(np.mean(np.asarray(buf)[:, :steps] != np.stack(host_tokens[1:], axis=1)))
  first_timed = dec.steps
  loop = []
  for _ in range(reps):
    t0 = time.perf_counter()
    _, tok = dec.run_buffer(tok, steps)
    tok.block_until_ready()
    loop.append((time.perf_counter() - t0) / steps)
  kv_slots = prompt_len + (first_timed + dec.steps - 1) / 2  # step i (prefill = 0) fills slot prompt_len + i - 1
  kernels = None
  if trace:
    kernels, tok = trace_loop(dec, tok, steps)
  tpe = np.asarray(dec.tokens_per_expert)
  distinct = (tpe > 0).sum(-1) if tpe.size else np.zeros((0,))
  assert int(tok.min()) >= 0 and int(tok.max()) < model.cfg.vocab_size
  step = statistics.median(loop)
  return dict(step_ms=1e3 * step, step_ms_host=1e3 * statistics.median(host),
              step_ms_synced=1e3 * statistics.median(synced), tokens_per_s=batch / step, prefill_s=prefill_s,
              compile_s=compile_s, loop_compile_s=loop_compile_s, chunk=chunk, kv_slots=kv_slots,
              loop_tokens_differ=loop_vs_host,
              distinct=distinct.tolist(), static_slots=min(batch * model.cfg.top_k, model.cfg.num_experts),
              kernels=kernels)


def parse_overrides(text: str) -> dict:
  """"key=value,key=value" -> {key: value} for TransformerConfig fields; values are ints, floats, true/false
  or strings. An unknown field or a malformed pair raises a one-line ValueError."""
  from sparsejax.models import TransformerConfig
  fields = {f.name for f in dataclasses.fields(TransformerConfig)}
  out = {}
  for pair in filter(None, text.split(",")):
    key, eq, raw = pair.partition("=")
    key = key.strip()
    if not eq or not raw.strip():
      raise ValueError(f"--set takes key=value pairs; got {pair!r}.")
    if key not in fields:
      raise ValueError(f"--set: {key!r} is not a TransformerConfig field (known: {', '.join(sorted(fields))}).")
    raw = raw.strip()
    if raw.lower() in ("true", "false"):
      out[key] = raw.lower() == "true"
      continue
    for kind in (int, float):
      try:
        out[key] = kind(raw)
        break
      except ValueError:
        pass
    else:
      out[key] = raw
  return out


def bench_preset(preset: str, batches: list[int], args, bandwidth: float) -> list[dict]:
  """Rows of one preset (with args.set's fields replaced, its rows named args.label) at each batch size."""
  dtype = args.dtype
  cfg = get_preset(preset, dtype=dtype, param_dtype=dtype, **args.overrides)
  if args.overrides:
    preset = args.label or f"{preset}+set"
  need = decode_slots(args.prompt_len, args.warmup, args.steps, args.reps)
  cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, need))
  t0 = time.perf_counter()
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  log(f"{preset}: built in {time.perf_counter() - t0:.1f} s"
      + (f" ({cfg.d_model=}, {cfg.num_layers=}, {cfg.d_ff=}, {cfg.num_experts=}, {cfg.top_k=}, {cfg.glu=})"
         if args.overrides else ""))
  variants = [("bf16" if dtype == "bfloat16" else dtype, model)]
  if cfg.moe_every and not args.no_int8:
    variants.append(("int8", None))  # quantized after the float variant, so both never sit in memory
  rows, ref_logits = [], {}
  for variant, m in variants:
    if variant == "int8":
      m = quantize_model(model)
      del model, variants
      gc.collect()
    for b in batches:
      row = dict(preset=preset, variant=variant, batch=b, dtype=dtype)
      try:
        if not args.no_check:
          check_prompt = jax.random.randint(jax.random.key(b), (b, args.check_len), 1, cfg.vocab_size)
          t0 = time.perf_counter()
          rel, logits = check_step(m, check_prompt)
          log(f"  {preset} {variant} batch {b}: checked against the full forward in {time.perf_counter() - t0:.1f} s")
          row["rel_err_vs_full_forward"] = rel
          assert rel < args.tol, f"decode step differs from the full forward: rel err {rel:.2e}"
          if variant == "int8":
            ref = ref_logits[b]
            row["rel_err_int8_vs_float"] = float(np.linalg.norm(logits - ref) / np.linalg.norm(ref))
            assert row["rel_err_int8_vs_float"] < 0.1, row
          else:
            ref_logits[b] = logits
        row.update(time_decode(m, b, args.prompt_len, args.warmup, args.steps, args.reps, seed=b,
                               trace=args.trace, chunk=args.chunk))
        by = step_bytes(m, b, row["kv_slots"], np.asarray(row["distinct"]))
        row.update({f"bytes_{k}": v for k, v in by.items()})
        row["bound_ms"] = 1e3 * by["total"] / bandwidth
        row["x_bound"] = row["step_ms"] / row["bound_ms"]
        row["small_batch_path"] = bool(cfg.moe_every) and b * cfg.top_k <= SMALL_BATCH_MAX_ASSIGNMENTS
      except Exception as e:  # noqa: BLE001 - one failing config must not lose the others
        row["error"] = f"{type(e).__name__}: {e}"[:300]
      log(_fmt_row(row))
      if row.get("loop_tokens_differ"):
        log(f"  device loop vs host steps from one cache: {row['loop_tokens_differ']:.1%} of greedy tokens differ")
      if row.get("kernels"):
        log(*kernel_lines(row["kernels"]), sep="\n")
      rows.append(row)
    del m
    gc.collect()
  return rows


HEADER = ("| preset | experts | batch | step ms | host step ms | tokens/s | bound ms | x bound | expert MB read "
          "| other MB | KV MB "
          "| distinct experts / layer | err vs full fwd | err int8 vs float |")


def _fmt_row(r: dict) -> str:
  if "error" in r:
    return f"| {r['preset']} | {r['variant']} | {r['batch']} | error: {r['error'][:120]} |"
  mb = lambda k: f"{r[k] / 1e6:,.1f}"
  distinct = f"{np.mean(r['distinct']):.1f} (of {r['static_slots']} slots)" if r["distinct"] else "-"
  int8 = f"{r['rel_err_int8_vs_float']:.1e}" if "rel_err_int8_vs_float" in r else "-"
  full = f"{r['rel_err_vs_full_forward']:.1e}" if "rel_err_vs_full_forward" in r else "unchecked"
  return (f"| {r['preset']} | {r['variant']} | {r['batch']} | {r['step_ms']:.3f} | {r['step_ms_host']:.3f} | "
          f"{r['tokens_per_s']:,.0f} | "
          f"{r['bound_ms']:.3f} | {r['x_bound']:.2f} | {mb('bytes_experts')} | {mb('bytes_other')} | "
          f"{mb('bytes_kv')} | {distinct} | {full} | {int8} |")


def targets(rows: list[dict]) -> list[str]:
  """The issue's targets, as lines of the report (only those whose rows were measured)."""
  ok = {(r["preset"], r["variant"], r["batch"]): r for r in rows if "error" not in r}
  out = []
  for (p, v, b), r in ok.items():
    if p == "medium-moe" and b == 1:
      out.append(f"- medium MoE ({v}) at batch 1: {r['x_bound']:.2f}x the memory bound (target <= 2x).")
  for b in sorted({k[2] for k in ok}):
    for size in ("tiny", "xs", "small", "medium"):
      dense = next((r for (p, v, bb), r in ok.items() if p == f"{size}-dense" and bb == b), None)
      moe = next((r for (p, v, bb), r in ok.items() if p == f"{size}-moe" and bb == b and v != "int8"), None)
      if dense and moe:
        target = " (target >= 0.67)" if (size, b) == ("xs", 1) else ""  # the issue sets it for MoE-XS at batch 1 only
        out.append(f"- {size} MoE / dense tokens/s at batch {b}: "
                   f"{moe['tokens_per_s'] / dense['tokens_per_s']:.2f}{target}.")
      q = next((r for (p, v, bb), r in ok.items() if p == f"{size}-moe" and bb == b and v == "int8"), None)
      if q and moe:
        out.append(f"- {size} MoE int8 / float at batch {b}: expert bytes {q['bytes_all_experts'] / moe['bytes_all_experts']:.2f}x, "
                   f"step time {q['step_ms'] / moe['step_ms']:.2f}x (speed-up {moe['step_ms'] / q['step_ms']:.2f}x).")
  return out


def write_outputs(results: dict, out_dir: str, name: str) -> str:
  os.makedirs(out_dir, exist_ok=True)
  stem = os.path.join(out_dir, f"decode_{name}")
  with open(stem + ".json", "w") as fh:
    json.dump(results, fh, indent=1)
  table = "\n".join([HEADER, "|" + "---|" * (HEADER.count("|") - 1)] + [_fmt_row(r) for r in results["rows"]])
  report = (f"# Decode on {results['device']}\n\n{results['dtype']} weights, prompt {results['prompt_len']} tokens, "
            f"copy bandwidth {results['copy_GBps']:,.0f} GB/s (read + write). Bound = bytes one step must read / "
            f"bandwidth. Step ms: one device-loop call of {results['steps']} steps (Decoder.run, chunk "
            f"{results['chunk']}) / {results['steps']}, median; host step ms: one Python-driven jitted call per "
            f"step, back to back, median.\n\n{table}\n\n" + "\n".join(results["targets"]) + "\n")
  with open(stem + ".md", "w") as fh:
    fh.write(report)
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in results["rows"] if "error" not in r]
    labels = [f"{r['preset']}\n{r['variant']} b{r['batch']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(rows)), 5))
    ax.bar(x - 0.2, [r["step_ms"] for r in rows], 0.4, label="decode step")
    ax.bar(x + 0.2, [r["bound_ms"] for r in rows], 0.4, label="memory bound (bytes / copy bandwidth)")
    ax.set_xticks(x, labels, fontsize=7, rotation=60, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Decode step vs memory bound, {results['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
    plt.close(fig)
  except Exception as e:  # noqa: BLE001
    log("plot failed:", e)
  copy_to_out(*(stem + ext for ext in (".json", ".md", ".png")))
  return report


def quantization_val_loss(run: str, data: str | None, batch_size: int, seq_len: int, batches: int) -> dict:
  """Validation loss (nats/token) of a trained run's checkpoint with float experts and with int8 experts."""
  from sparsejax.data import eval_batches, load_corpus
  from sparsejax.inference.cli import load_model
  from sparsejax.models import cross_entropy
  model, meta = load_model(run)
  val = eval_batches(load_corpus(data).val, batch_size, seq_len, batches)
  loss = nnx.jit(lambda m, x, y: cross_entropy(m(x)[0], y))
  mean = lambda m: float(np.mean([loss(m, x, y) for x, y in val]))
  before = mean(model)
  after = mean(quantize_model(model))
  rec = dict(run=run, step=meta["step"], preset_config=meta["model_config"], val_loss_float=before,
             val_loss_int8=after, val_batches=batches, batch_size=batch_size, seq_len=seq_len)
  log(f"{run} (step {meta['step']}): val loss {before:.4f} float experts, {after:.4f} int8 experts "
      f"({after - before:+.4f})")
  return rec


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--smoke", action="store_true", help="tiny presets, few steps (runs on a CPU)")
  ap.add_argument("--presets", default=",".join(PRESETS))
  ap.add_argument("--batches", default="1,32")
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--check-len", type=int, default=16, help="prompt length of the correctness check")
  ap.add_argument("--warmup", type=int, default=8)
  ap.add_argument("--steps", type=int, default=32, help="steps per timed repetition")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--dtype", default=None, help="default: bfloat16 on accelerators, float32 on CPU")
  ap.add_argument("--no-int8", action="store_true")
  ap.add_argument("--no-check", action="store_true",
                  help="skip the check of each step against the full forward (and int8 against float): for "
                  "timing a change already checked, at about half the compile time (a medium preset's check "
                  "compiles the 24-layer forward and prefill twice more)")
  ap.add_argument("--trace", action="store_true", help="also trace one device-loop call: kernel time per op "
                  "and step (GPU)")
  ap.add_argument("--chunk", type=int, default=DECODE_CHUNK, help="steps per inner device loop (Decoder chunk); "
                  "--steps should be a multiple of it, else each timed call also runs the wasted rest of a chunk")
  ap.add_argument("--set", default="", help="TransformerConfig fields to replace in every preset, "
                  "key=value[,key=value] (e.g. d_model=4096,num_layers=8): a model shape outside the presets")
  ap.add_argument("--label", default="", help="the rows' name for a --set model (default: <preset>+set)")
  ap.add_argument("--copy-mb", type=int, default=2048)
  ap.add_argument("--copy-warmup-s", type=float, default=1.0, help="seconds of copies before the copy bandwidth is timed")
  ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--val-runs", default="", help="comma-separated trained MoE runs: report their validation "
                  "loss with float and with int8 experts (and skip the timing unless --presets is given)")
  ap.add_argument("--val-data", default=None, help="the runs' corpus (default: the stdlib, as sparsejax-train)")
  ap.add_argument("--val-seq-len", type=int, default=128)
  args = ap.parse_args(argv)
  if args.chunk < 1:
    ap.error(f"--chunk must be >= 1; got {args.chunk}")
  try:
    args.overrides = parse_overrides(args.set)
  except ValueError as e:
    ap.error(str(e))
  if args.label and not args.overrides:
    ap.error("--label names a --set model; give --set too")
  if args.val_runs:
    recs = [quantization_val_loss(r, args.val_data, 16, args.val_seq_len, 8) for r in args.val_runs.split(",")]
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "int8_val_loss.json")
    with open(path, "w") as fh:
      json.dump(recs, fh, indent=1)
    copy_to_out(path)
    if "--presets" not in (argv or sys.argv):
      return dict(val=recs)
  dev = jax.devices()[0]
  args.dtype = args.dtype or ("float32" if dev.platform == "cpu" else "bfloat16")
  if args.smoke:
    args.presets, args.batches = "tiny-dense,tiny-moe", "1,4"
    args.prompt_len, args.check_len, args.warmup, args.steps, args.reps, args.copy_mb = 8, 6, 1, 3, 2, 16
    args.copy_warmup_s = 0.05
    args.chunk = min(args.chunk, args.steps)  # a loop call of `steps` steps wastes none
  args.tol = 2e-2 if args.dtype == "bfloat16" else 1e-3
  name = (dev.device_kind.replace(" ", "_").replace("/", "_") if dev.platform == "gpu" else dev.platform)
  name += "_smoke" if args.smoke else ""
  log(f"jax {jax.__version__} on {dev.device_kind}; sparsejax source {source_fingerprint()}")
  bandwidth = copy_bandwidth(args.copy_mb << 20, args.copy_warmup_s)
  log(f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s (read + write of {args.copy_mb} MiB)")
  results = dict(device=dev.device_kind, jax=jax.__version__, sparsejax_source=source_fingerprint(),
                 dtype=args.dtype, prompt_len=args.prompt_len,
                 steps=args.steps, chunk=args.chunk,
                 copy_GBps=bandwidth / 1e9, small_batch_max_assignments=SMALL_BATCH_MAX_ASSIGNMENTS,
                 config_set=args.overrides, rows=[],
                 targets=[])
  batches = [int(b) for b in args.batches.split(",")]
  log(HEADER)
  for preset in args.presets.split(","):
    results["rows"] += bench_preset(preset, batches, args, bandwidth)
    results["targets"] = targets(results["rows"])
    write_outputs(results, args.out_dir, name)  # partial results survive a timeout
  report = write_outputs(results, args.out_dir, name)
  log("\n" + report)
  return results


if __name__ == "__main__":
  main()
