"""Where a training step's device time goes: MoE-XS against dense-XS, per category, on one device.

For each preset the script builds the library's own train step (sparsejax.train: init_model,
functional, make_optimizer, make_steps, with the optimizer's update under a named scope), compiles
it ahead of time, times `--steps` steps after `--warmup`, then traces `--steps` more with
jax.profiler. It reads the trace (the trace-viewer `*.trace.json.gz` jax.profiler writes) and the
compiled HLO, and gives every executed op's self time to one category:

  attention          the attention sublayer: QKV/out projections, RoPE, the attention kernel
  expert/ffn matmuls expert matmuls (Pallas gmm/tgmm, ragged_dot, batched einsum) of MoE layers,
                     the dense MLP's matmuls in dense layers
  activation         the FFN activation (and any other non-matmul op of the FFN)
  router and top-k   router logits (float32), softmax, top-k, jitter
  placement          ranks and rows of the expert buffer (argsort or histogram, cumsums)
  topology           the block-sparse topology of the padded layout
  gather/scatter     rows into the expert buffer and back out (combine)
  aux losses         load-balancing and z losses
  norms              RMSNorms
  embed, head, loss  token embedding, LM head, cross-entropy
  optimizer          clipping, AdamW, apply_updates (and the step's other unscoped bookkeeping)
  other              the rest: residual adds, casts, copies, and ops the trace could not name

Ops are named by the HLO op each kernel (GPU) or thunk (CPU) runs; a fusion takes the category of
its heaviest instructions (matmuls, then sorts/scatters/gathers/reductions, then elementwise),
read from their op_name metadata, whose path carries the library's jax.named_scope names
("attention", "router", "placement", "expert_ffn", ...). Fused ops of two categories count once,
for the heavier. On the GPU, command buffers (CUDA graphs) are turned off while profiling so that
every kernel carries its HLO op; --keep-command-buffers leaves them on.

FLOP convention (MFU, and the same as sparsejax.train's): TransformerConfig.flops_per_token =
6 * N_active + 12 * L * d * T per token (PaLM, appendix B): N_active counts the non-embedding
weights a token multiplies by (attention 4 d^2, top_k experts' FFN 2 d d_ff each, the router
d E, the LM head d V; the embedding lookup is free), the 12 L d T term the attention scores and
values (causal masking not discounted). MFU = that * tokens per step / step time / peak dense
bf16 FLOP/s (989e12 on H100 SXM). Padding rows, dropped tokens and recomputation count nothing.

Writes experiments/results/profile_<preset>_<device>.{md,json} for each preset and
profile_<device>.md side by side (copies under $OUT when set).

  python experiments/profile_step.py                      # GPU: xs-moe and xs-dense, 32 x 1024 tokens
  python experiments/profile_step.py --presets xs-moe --set moe_impl=ragged_dot
  python experiments/profile_step.py --smoke              # CPU: tiny models, seconds
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from sparsejax.data import BatchStream, load_corpus  # noqa: E402
from sparsejax.train import (TrainConfig, cast_dtypes, compute_copy, functional, init_model,  # noqa: E402
                             make_optimizer, make_steps, mfu, peak_flops)
from out_dir import copy_to_out  # noqa: E402

CATEGORIES = ("attention", "expert/ffn matmuls", "activation", "router and top-k", "placement", "topology",
              "gather/scatter", "aux losses", "norms", "embed, head, loss", "optimizer", "other")
MOE_CATEGORIES = ("router and top-k", "placement", "gather/scatter", "aux losses")
SCOPES = {  # jax.named_scope in the library -> category
    "attention": "attention", "router": "router and top-k", "placement": "placement",
    "topology": "topology", "gather_rows": "gather/scatter", "scatter_rows": "gather/scatter",
    "aux_losses": "aux losses", "rms_norm": "norms", "embed": "embed, head, loss",
    "lm_head": "embed, head, loss", "cross_entropy": "embed, head, loss", "optimizer": "optimizer",
    "expert_ffn": "ffn", "dense_mlp": "ffn",
}
_SCOPE_RE = re.compile(r"(?<![\w.])(" + "|".join(SCOPES) + r")(?![\w.])")
MATMUL_OPCODES = {"dot", "convolution", "custom-call", "ragged-dot"}
# An op inside one of these (by op_name path) is part of a matmul: the Pallas kernels, whose
# interpret-mode loops (CPU) hold many small non-dot ops, and ragged_dot's expansions.
MATMUL_KERNELS = ("pallas_call", "sparsejax_gmm", "sparsejax_tgmm", "ragged_dot", "dot_general")
HEAVY = {"sort": 2, "scatter": 2, "gather": 2, "reduce": 2, "reduce-window": 2, "select-and-scatter": 2,
         "dynamic-slice": 2, "dynamic-update-slice": 2, "cumsum": 2}
IGNORED = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
SMOKE_MODEL = dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, num_experts=4, max_seq_len=64)


# ------------------------------------------------------------------ HLO: op name -> category
@dataclasses.dataclass
class HloOp:
  name: str
  opcode: str
  op_name: str
  calls: list[str]


def parse_hlo(text: str) -> tuple[dict[str, list[HloOp]], dict[str, HloOp]]:
  """(computation -> its instructions, instruction name -> instruction) of an HLO module's text."""
  comps, ops, current = {}, {}, None
  head = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
  inst = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
  for line in text.splitlines():
    m = inst.match(line) if current is not None else None
    if m:
      name, rest = m.groups()
      rest = _skip_type(rest)
      opcode = re.match(r"([\w\-]+)", rest).group(1) if re.match(r"[\w\-]+", rest) else ""
      op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', rest)
      calls = re.findall(r"(?:calls|body)=%?([\w.\-]+)", rest)
      op = HloOp(name, opcode, op_name.group(1) if op_name else "", calls)
      comps[current].append(op)
      ops[name] = op
      continue
    m = head.match(line)
    if m and not line.startswith(" "):
      current = m.group(1)
      comps[current] = []
    elif line.strip() == "}":
      current = None
  return comps, ops


def _skip_type(rest: str) -> str:
  """Drops the result type ('f32[8]{0}' or a parenthesised tuple) before the opcode."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        return rest[i + 1:].lstrip()
  return rest.split(" ", 1)[1] if " " in rest else rest


def classify(op_name: str, opcode: str) -> str:
  """The category of one HLO instruction from its op_name path (innermost library scope wins)."""
  scopes = _SCOPE_RE.findall(op_name)
  if not scopes:
    differentiated = "jvp(" in op_name or "transpose(" in op_name
    return "optimizer" if op_name.startswith("jit(") and not differentiated else "other"
  category = SCOPES[scopes[-1]]
  if category == "ffn":
    matmul = opcode in MATMUL_OPCODES or any(k in op_name for k in MATMUL_KERNELS)
    return "expert/ffn matmuls" if matmul else "activation"
  return category


def op_categories(hlo_text: str) -> dict[str, str]:
  """Instruction name -> category for every instruction of the module (fusions by their contents)."""
  comps, ops = parse_hlo(hlo_text)

  def leaves(op, seen):
    if not op.calls:
      return [op]
    out = []
    for c in op.calls:
      if c not in seen:
        seen.add(c)
        for inner in comps.get(c, []):
          out += leaves(inner, seen)
    return out or [op]

  result = {}
  for name, op in ops.items():
    votes, best = collections.Counter(), 0
    for leaf in leaves(op, set()):
      if leaf.opcode in IGNORED or not leaf.op_name:
        continue
      rank = 3 if leaf.opcode in MATMUL_OPCODES else HEAVY.get(leaf.opcode, 1)
      if rank > best:
        votes, best = collections.Counter(), rank
      if rank == best:
        votes[classify(leaf.op_name, leaf.opcode)] += 1
    if not votes and op.op_name:
      votes[classify(op.op_name, op.opcode)] += 1
    result[name] = votes.most_common(1)[0][0] if votes else "other"
  return result


# ------------------------------------------------------------------ the trace: op -> self time
def load_trace(log_dir: str) -> dict:
  paths = sorted(glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"jax.profiler wrote no *.trace.json.gz under {log_dir}")
  with gzip.open(paths[-1]) as f:
    return json.load(f)


def _trace_lines(trace: dict):
  """(complete events, the device processes' pids, event -> the name of its thread line)."""
  events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
  meta = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
  procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
  # A device with no events is not the one that ran: jax 0.11 on a GPU machine names its GPU's process in a trace of
  # the CPU backend (JAX_PLATFORMS=cpu), and the ops are then on the host's lines.
  busy = {e["pid"] for e in events}
  devices = {pid for pid, name in procs.items() if name.startswith("/device:") and pid in busy}
  return events, devices, lambda e: threads.get((e["pid"], e.get("tid")), "")


def op_times(trace: dict, module: str) -> tuple[dict[str, float], float]:
  """(HLO op -> self time in us, unattributed device time in us) of the module's executions.

  GPU: kernels and copies on the device's stream lines (a kernel's op is its hlo_op arg); the
  derived 'XLA Ops' line serves when no stream line has them. CPU: the thunk executor's events.
  Self time: an event's duration less that of the events nested inside it on the same line.
  """
  events, devices, line = _trace_lines(trace)
  if devices:
    on_device = [e for e in events if e["pid"] in devices]
    picked = [e for e in on_device if line(e).startswith("Stream")]
    if not any("hlo_op" in e.get("args", {}) for e in picked):
      picked = [dict(e, args={**e.get("args", {}), "hlo_op": e["name"].lstrip("%").split(" ")[0]})
                for e in on_device if line(e) == "XLA Ops"]
  else:
    picked = [e for e in events if "hlo_op" in e.get("args", {})]
  mod = lambda e: e.get("args", {}).get("hlo_module", "")
  ours = [e for e in picked if not mod(e) or mod(e) == module or mod(e).startswith(module + "(")]
  picked = ours or picked  # module named otherwise: only the step ran while tracing anyway
  times, unattributed = collections.defaultdict(float), 0.0
  by_line = collections.defaultdict(list)
  for e in picked:
    by_line[(e["pid"], e.get("tid"))].append(e)
  for evs in by_line.values():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack, self_time = [], {}
    for i, e in enumerate(evs):
      # Only an event that ends inside the open one is nested in it: kernels of one stream that
      # overlap by a few ns (launch timestamps) are neighbours, and their time is their own.
      while stack and evs[stack[-1]]["ts"] + evs[stack[-1]]["dur"] < e["ts"] + e["dur"]:
        stack.pop()
      if stack:
        self_time[stack[-1]] -= e["dur"]
      self_time[i] = e["dur"]
      stack.append(i)
    for i, e in enumerate(evs):
      op = e.get("args", {}).get("hlo_op")
      if op:
        times[op] += max(self_time[i], 0.0)
      else:
        unattributed += max(self_time[i], 0.0)
  return dict(times), unattributed


def stream_kernels(trace: dict) -> list[dict]:
  """The trace's kernel and copy events on the device stream lines, by start time."""
  events, devices, line = _trace_lines(trace)
  return sorted((e for e in events if e["pid"] in devices and line(e).startswith("Stream")), key=lambda e: e["ts"])


def kernel_kind(e: dict) -> str:
  """A kernel's name without its instance number (loop_add_fusion_49 -> loop_add_fusion): the kernels of
  one kind across a model's layers, where each layer's instance has its own HLO op. A "__N" suffix stays:
  it tells apart different kernels given one name (sparsejax_skinny_matmul, sparsejax_skinny_matmul__1)."""
  return re.sub(r"(?<![._])[._]\d+$", "", e["name"][:80])


def kernel_table(trace: dict, steps: int, top: int = 20, *, by_kind: bool = False) -> dict:
  """Raw device time per kernel (no nesting subtracted): [(op or kernel name, ms per step, launches per step)],
  and the union of busy intervals per step. by_kind: grouped by kernel_kind instead of by HLO op."""
  kernels = stream_kernels(trace)
  by = collections.defaultdict(lambda: [0.0, 0])
  busy, end = 0.0, None
  for e in kernels:
    key = kernel_kind(e) if by_kind else (e.get("args", {}).get("hlo_op") or e["name"][:80])
    by[key][0] += e["dur"]
    by[key][1] += 1
    lo, hi = e["ts"], e["ts"] + e["dur"]
    if end is None or lo >= end:
      busy += hi - lo
      end = hi
    elif hi > end:
      busy += hi - end
      end = hi
  rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
  return {"busy_union_ms": busy / 1e3 / steps,
          "kernels": [(k, v[0] / 1e3 / steps, v[1] / steps) for k, v in rows]}


def device_gaps(trace: dict, module: str, steps: int, cats: dict[str, str]) -> dict:
  """Per step: the device's idle time between the module's kernels, by the category of the op that waited.

  The kernels of one device (all its stream lines) are merged into busy intervals; a gap is the
  time from the end of one interval to the start of the next kernel, charged to that kernel's op:
  the GPU was waiting for the host to launch it (or for a host-side callback). Gaps between steps
  (the next step's launch) are charged to "between steps".
  """
  kernels = stream_kernels(trace)
  if not kernels:
    return {}
  mod = lambda e: e.get("args", {}).get("hlo_module", "")
  by_cat, first_ops, end, total = collections.Counter(), set(), None, 0.0
  for e in kernels:
    op = e.get("args", {}).get("hlo_op", "")
    if end is not None and e["ts"] > end:
      gap = e["ts"] - end
      total += gap
      name = "between steps" if mod(e) and mod(e).split("(")[0] != module else cats.get(op, "other")
      by_cat[name] += gap
    end = max(end or 0.0, e["ts"] + e["dur"])
  span = end - kernels[0]["ts"]
  return {"span_ms": span / 1e3 / steps, "idle_ms": total / 1e3 / steps,
          "idle_by_category_ms": {c: us / 1e3 / steps for c, us in by_cat.most_common()},
          "kernels_per_step": len(kernels) / steps}


# ------------------------------------------------------------------ one preset
def _scoped(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """tx with its update under jax.named_scope("optimizer"), so the profile can name its ops."""
  def update(grads, state, params=None):
    with jax.named_scope("optimizer"):
      return tx.update(grads, state, params)
  return optax.GradientTransformation(tx.init, update)


def profile_preset(preset: str, args, corpus) -> dict:
  overrides = {**(SMOKE_MODEL if args.smoke else {}), **args.overrides}
  cfg = TrainConfig(preset=preset, batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype,
                    steps=10**6, adam_mu_dtype=args.adam_mu_dtype, grad_accum=args.grad_accum,
                    model_overrides=overrides)
  model_cfg = cfg.model_config()
  if corpus.vocab_size != model_cfg.vocab_size:
    model_cfg = model_cfg.replace(vocab_size=corpus.vocab_size)
  # One jitted init instead of one eager compile per initializer (the same values).
  apply, _ = functional(nnx.eval_shape(lambda: init_model(cfg, model_cfg)))
  params = jax.jit(lambda: functional(init_model(cfg, model_cfg))[1])()
  tx = _scoped(make_optimizer(cfg))
  opt_state = jax.jit(tx.init)(params)
  # As sparsejax.train runs it: AdamW writes the bf16 copy of the weights the forward casts.
  train_step, _ = make_steps(apply, tx, cfg.seed, with_copy=True, grad_accum=cfg.grad_accum)
  stream = BatchStream(corpus.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
  n = args.warmup + 2 * args.steps
  batches = [jax.device_put(next(stream)) for _ in range(n)]
  step_ids = [jax.device_put(jnp.int32(i)) for i in range(n)]
  dtypes = cast_dtypes(apply, params, batches[0][0], rng=jax.random.key(cfg.seed))
  if args.no_compute_copy:  # the forward casts every weight itself, as before the copy
    dtypes = jax.tree.map(lambda d: None, dtypes)
  copy = compute_copy(params, dtypes)
  t0 = time.perf_counter()
  compiled = train_step.lower(params, opt_state, *batches[0], step_ids[0], copy).compile()
  compile_s = time.perf_counter() - t0
  hlo = compiled.as_text()
  module = re.match(r"HloModule\s+([\w.\-]+)", hlo).group(1)

  def run(lo, hi):
    nonlocal params, opt_state, copy
    m = None
    for i in range(lo, hi):
      params, opt_state, m, copy = compiled(params, opt_state, *batches[i], step_ids[i], copy)
    jax.block_until_ready((params, opt_state, m, copy))

  run(0, args.warmup)
  t = time.perf_counter()
  run(args.warmup, args.warmup + args.steps)  # back to back, as a training loop runs them
  pipelined_ms = 1e3 * (time.perf_counter() - t) / args.steps
  step_s = []
  for i in range(args.warmup, args.warmup + args.steps):
    t = time.perf_counter()
    run(i, i + 1)
    step_s.append(time.perf_counter() - t)
  options = jax.profiler.ProfileOptions()
  options.host_tracer_level = 3  # XLA:CPU names its thunks only at this level
  options.python_tracer_level = 0
  log_dir = args.keep_trace or tempfile.mkdtemp(prefix="profile_step_")
  trace_dir = os.path.join(log_dir, preset)
  with jax.profiler.trace(trace_dir, profiler_options=options):
    run(args.warmup + args.steps, n)
  trace = load_trace(trace_dir)
  times, unattributed = op_times(trace, module)
  if not args.keep_trace:
    shutil.rmtree(log_dir, ignore_errors=True)
  if not times:
    raise RuntimeError(f"the trace holds no op of {module}; nothing to categorize")
  cats = op_categories(hlo)
  gaps = device_gaps(trace, module, n - args.warmup - args.steps, cats)
  raw = kernel_table(trace, n - args.warmup - args.steps)
  per_step = lambda us: us / 1e3 / args.steps
  by_cat = collections.Counter()
  for op, us in times.items():
    by_cat[cats.get(op, "other")] += us
  by_cat["other"] += unattributed
  unmapped = sum(us for op, us in times.items() if op not in cats)
  device_ms = per_step(sum(by_cat.values()))
  step_ms = pipelined_ms  # the training loop's rate: steps back to back, one sync at the end
  single_ms = 1e3 * statistics.median(step_s)
  tokens = cfg.batch_size * cfg.seq_len
  flops = model_cfg.flops_per_token(cfg.seq_len) * tokens
  peak = peak_flops(jax.devices()[0].device_kind, 1, cfg.peak_flops)  # one device, as train() without a mesh
  top = sorted(times.items(), key=lambda kv: -kv[1])[:args.top_ops]
  return {
      "preset": preset, "overrides": overrides, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
      "grad_accum": cfg.grad_accum,
      "dtype": model_cfg.dtype, "moe_impl": model_cfg.moe_impl if model_cfg.moe_every else None,
      "compute_copy": bool(jax.tree.leaves(copy)),  # the forward read AdamW's compute-dtype weights
      "hlo_module": module, "compile_s": compile_s, "steps_traced": args.steps,
      "command_buffers": args.keep_command_buffers or jax.default_backend() != "gpu",
      "step_ms": step_ms, "single_step_ms": single_ms, "device_ms": device_ms, "gaps": gaps, "raw_kernels": raw, "tokens_per_s": tokens / (step_ms / 1e3),
      "flops_per_step": flops, "mfu": mfu(flops, 1, step_ms / 1e3, peak),
      "categories_ms": {c: per_step(by_cat.get(c, 0.0)) for c in CATEGORIES},
      "share": {c: by_cat.get(c, 0.0) / max(sum(by_cat.values()), 1e-12) for c in CATEGORIES},
      "unattributed_ms": per_step(unattributed),  # device time of no HLO op (in "other")
      "unmapped_ms": per_step(unmapped),  # ops missing from the compiled HLO's text (in "other")
      "top_ops": [{"op": op, "category": cats.get(op, "other"), "ms": per_step(us)} for op, us in top],
      # Every op, so a category can be broken down after the run (the router's, say).
      "ops": [{"op": op, "category": cats.get(op, "other"), "ms": per_step(us)}
              for op, us in sorted(times.items(), key=lambda kv: -kv[1])],
  }


# ------------------------------------------------------------------ report
PER_CATEGORY = 4
FLOP_NOTE = ("FLOPs per token = 6 N_active + 12 L d T (PaLM app. B; N_active: non-embedding weights a token "
             "multiplies by, top_k experts + router in MoE layers); MFU = FLOPs/step / step time / peak bf16.")


def _mfu(r: dict) -> str:
  return "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"


def preset_markdown(r: dict, device: str) -> str:
  accum = r.get("grad_accum", 1)
  lines = [f"# Training step of {r['preset']} on {device}", "",
           f"batch {r['batch_size']} x {r['seq_len']} tokens"
           + ("" if accum == 1 else f" ({accum} microbatches of {r['batch_size'] // accum}, one AdamW update)")
           + f", {r['dtype']}, moe_impl {r['moe_impl']}; "
           + ("weights read from AdamW's compute-dtype copy; " if r.get("compute_copy") else "")
           + f"{r['steps_traced']} steps traced"
           + ("." if r["command_buffers"] else ", CUDA graphs off (as while timing the step)."), "",
           f"step {r['step_ms']:.2f} ms (wall, {r['steps_traced']} steps back to back; one step alone "
           f"{r['single_step_ms']:.2f} ms), device busy {r['device_ms']:.2f} ms, "
           f"{r['tokens_per_s']:,.0f} tokens/s, MFU {_mfu(r)}", "",
           FLOP_NOTE, "", "| category | ms / step | share |", "|---|---|---|"]
  lines += [f"| {c} | {r['categories_ms'][c]:.3f} | {100 * r['share'][c]:.1f}% |" for c in CATEGORIES]
  g = r.get("gaps") or {}
  if g:
    lines += ["", f"Device idle while the steps ran back to back: {g['idle_ms']:.2f} ms of a "
              f"{g['span_ms']:.2f} ms span per step ({g['kernels_per_step']:.0f} kernels per step), "
              "charged to the op that waited for its launch:", "", "| waiting op's category | idle ms / step |",
              "|---|---|"]
    lines += [f"| {c} | {ms:.3f} |" for c, ms in g["idle_by_category_ms"].items()]
  raw = r.get("raw_kernels") or {}
  if raw.get("kernels"):
    lines += ["", f"Raw kernel time (events' whole durations, nothing nested subtracted; union of busy "
              f"intervals {raw['busy_union_ms']:.2f} ms / step):", "", "| kernel (op) | ms / step | launches / step |",
              "|---|---|---|"]
    lines += [f"| {k} | {ms:.3f} | {n:.1f} |" for k, ms, n in raw["kernels"]]
  lines += ["", "Heaviest ops:", "", "| op | category | ms / step |", "|---|---|---|"]
  lines += [f"| {o['op']} | {o['category']} | {o['ms']:.3f} |" for o in r["top_ops"]]
  lines += ["", f"Heaviest {PER_CATEGORY} ops of each category (every op is in the JSON's \"ops\"):", "",
            "| category | op | ms / step |", "|---|---|---|"]
  for c in CATEGORIES:
    ops = [o for o in r.get("ops", []) if o["category"] == c][:PER_CATEGORY]
    lines += [f"| {c} | {o['op']} | {o['ms']:.3f} |" for o in ops]
  return "\n".join(lines) + "\n"


def comparison_markdown(results: list[dict], device: str) -> str:
  names = [r["preset"] for r in results]
  lines = [f"# Training step per category on {device}", "", FLOP_NOTE, "",
           "| category | " + " | ".join(f"{n} ms | {n} share" for n in names) + " |",
           "|---|" + "---|---|" * len(names)]
  for c in CATEGORIES:
    lines.append(f"| {c} | " + " | ".join(f"{r['categories_ms'][c]:.3f} | {100 * r['share'][c]:.1f}%"
                                          for r in results) + " |")
  lines.append("| **device idle ms** | " + " | ".join(f"{(r.get('gaps') or {}).get('idle_ms', float('nan')):.2f} | "
                                                     for r in results) + " |")
  for label, key, spec in (("device busy ms", "device_ms", ".2f"), ("step ms (wall)", "step_ms", ".2f"),
                           ("tokens/s", "tokens_per_s", ",.0f")):
    lines.append(f"| **{label}** | " + " | ".join(f"{r[key]:{spec}} | " for r in results) + " |")
  lines.append("| **MFU** | " + " | ".join(f"{_mfu(r)} | " for r in results) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--presets", nargs="+", default=None, help="default: xs-moe xs-dense (smoke: tiny-moe tiny-dense)")
  p.add_argument("--smoke", action="store_true", help="tiny models and few steps: checks the script on a CPU")
  p.add_argument("--batch-size", type=int, default=None, help="default 32 (smoke 2)")
  p.add_argument("--seq-len", type=int, default=None, help="default 1024 (smoke 32)")
  p.add_argument("--dtype", default=None, help="compute dtype (default bfloat16 on GPU, float32 on CPU)")
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="override a TransformerConfig field, e.g. --set moe_impl=ragged_dot")
  p.add_argument("--data", default=None, help="corpus (default: the Python standard library)")
  p.add_argument("--adam-mu-dtype", default="float32", choices=("float32", "bfloat16"),
                 help="AdamW's first-moment dtype (TrainConfig.adam_mu_dtype)")
  p.add_argument("--grad-accum", type=int, default=1,
                 help="microbatches per step (the step's batch is --batch-size sequences; one AdamW update)")
  p.add_argument("--tag", default="", help="after 'profile' in the result files' names (e.g. _b128)")
  p.add_argument("--no-compute-copy", action="store_true",
                 help="the forward casts the float32 weights, instead of reading the bf16 copy AdamW writes")
  p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5, smoke 1)")
  p.add_argument("--steps", type=int, default=None, help="timed steps, then as many traced (default 10, smoke 2)")
  p.add_argument("--top-ops", type=int, default=15, help="heaviest ops listed per preset")
  p.add_argument("--keep-trace", default=None, metavar="DIR", help="write the traces here and keep them")
  p.add_argument("--keep-command-buffers", action="store_true",
                 help="leave XLA's CUDA graphs on (kernels inside them may lose their HLO op)")
  p.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
  args = p.parse_args(argv)
  defaults = (dict(presets=["tiny-moe", "tiny-dense"], batch_size=2, seq_len=32, warmup=1, steps=2) if args.smoke
              else dict(presets=["xs-moe", "xs-dense"], batch_size=32, seq_len=1024, warmup=5, steps=10))
  for k, v in defaults.items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  args.overrides = {}
  for item in args.set:
    name, sep, value = item.partition("=")
    if not sep:
      p.error(f"--set {item!r}: expected FIELD=VALUE")
    try:
      args.overrides[name] = json.loads(value)
    except json.JSONDecodeError:
      args.overrides[name] = value
  if not args.keep_command_buffers and "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    # Read when the backend starts: a no-op if this process already started one.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

  device = jax.devices()[0].device_kind
  slug = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_")
  corpus = load_corpus(args.data)
  results = []
  for preset in args.presets:
    print(f"=== {preset}", flush=True)
    r = profile_preset(preset, args, corpus)
    results.append(r)
    print(preset_markdown(r, device), flush=True)
    jax.clear_caches()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  written = []
  for r in results:
    stem = f"profile{args.tag}_{r['preset']}_{slug}"
    (out / f"{stem}.json").write_text(json.dumps({"device": device, "flop_convention": FLOP_NOTE, **r}, indent=1))
    (out / f"{stem}.md").write_text(preset_markdown(r, device))
    written += [out / f"{stem}.json", out / f"{stem}.md"]
  (out / f"profile{args.tag}_{slug}.md").write_text(comparison_markdown(results, device))
  written.append(out / f"profile{args.tag}_{slug}.md")
  print(comparison_markdown(results, device))
  copy_to_out(*written)  # --out may be $OUT itself
  return {"device": device, "results": results, "written": [str(w) for w in written]}


if __name__ == "__main__":
  main()
