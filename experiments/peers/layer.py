"""The whole MoE layer through sparsejax.moe_mlp: routing, placement, experts, combine.

Variants: "dropless" (impl="auto": the Pallas kernels on a GPU, ragged_dot elsewhere),
"dropless_<impl>" for a named impl, "capacity_<cf>" (the Switch/GShard layer with capacity
factor cf, the batched-einsum experts) and "rounded" (`sj.rounded_moe_mlp`, impl="auto": every
expert a whole number of 128-row blocks, so not dropless; `dropped_fraction` and `added_fraction`
count the assignments rounding removed and added). The router is a real, differentiated layer; fixed Gumbel
noise plus a log-prior on its logits makes the top-k choice a sample of the shape's routing
distribution (uniform, or (i+1)^-0.5). Forward+backward: jax.value_and_grad of
sum(tanh(y) * ct) + load-balancing loss in x, the router and both expert weights.

The check compares the layer's forward output with a float32 reference built from the same routing
(ids, combine weights, the capacity keep mask): each kept assignment's expert MLP on a zero-padded
[E, max count, d] batch, weighted and summed per token. Its gradients are checked to be finite;
the expert MLP table checks the experts' gradients against a reference.
"""
from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import sparsejax as sj
from sparsejax.grouped_matmul import BLOCK_IMPLS, resolve_impl
from sparsejax.kernels.gmm import resolve_backend
from sparsejax.reference import capacity_keep_mask_reference

from peers.common import HIGHEST, OUT_TOL, Shape, mlp, rel_err


def parse_variant(label: str) -> tuple[str, float | None]:
  """"dropless" -> ("auto", None); "dropless_triton" -> ("triton", None); "capacity_1.0" -> ("auto", 1.0)."""
  if label in ("dropless", "rounded"):
    return "auto", None
  if label.startswith("dropless_"):
    return label[len("dropless_"):], None
  if label.startswith("capacity_"):
    return "auto", float(label[len("capacity_"):])
  raise ValueError(f"layer variant must be dropless, dropless_<impl>, capacity_<cf> or rounded; got {label!r}")


@functools.partial(jax.jit, static_argnums=(0, 1))
def inputs(s: Shape, dtype=jnp.bfloat16) -> dict:
  keys = jax.random.split(jax.random.key(7), 6)
  bias = jax.random.gumbel(keys[5], (s.T, s.E))
  if s.skewed:
    bias = bias - 0.5 * jnp.log(jnp.arange(1, s.E + 1, dtype=jnp.float32))
  return dict(
      x=jax.random.normal(keys[0], (s.T, s.d), dtype),
      bias=bias,
      w_r=jax.random.normal(keys[1], (s.d, s.E), jnp.float32) * 0.02,
      w_in=(jax.random.normal(keys[2], (s.E, s.d, s.f)) / math.sqrt(s.d)).astype(dtype),
      w_out=(jax.random.normal(keys[3], (s.E, s.f, s.d)) / math.sqrt(s.f)).astype(dtype),
      ct=jax.random.normal(keys[4], (s.T, s.d), dtype))


def functions(s: Shape, impl: str, cf: float | None, rounded: bool = False):
  """(routing, forward, forward+backward) of the layer, jitted; arguments (x, bias, w_r, w_in, w_out[, ct])."""
  def top_k(x, bias, w_r):
    return sj.top_k_routing(sj.router_logits(x, w_r) + bias, s.k)

  def routing(x, bias, w_r):  # what the layer computes: the check's reference takes its ids and weights
    return sj.round_to_blocks(top_k(x, bias, w_r)) if rounded else top_k(x, bias, w_r)

  def layer(x, bias, w_r, w_in, w_out):
    r = top_k(x, bias, w_r)
    if rounded:
      return (*sj.rounded_moe_mlp(x, r, w_in, w_out, impl=impl), r)
    # Combine weights stay float32: the scatter accumulates in float32 (casting them to bf16
    # first would round them for nothing).
    y, stats = sj.moe_mlp(x, r.expert_ids, r.combine_weights, w_in, w_out, capacity_factor=cf,
                          impl=impl)
    return y, stats, r

  def loss(x, bias, w_r, w_in, w_out, ct):
    y, stats, r = layer(x, bias, w_r, w_in, w_out)
    # tanh stands for the layers above: the cotangent of y depends on y, as in training, so XLA
    # cannot start the backward before the forward ends (with a loss linear in y it merges the
    # forward and backward activation passes, which no training step can do).
    value = jnp.sum(jnp.tanh(y.astype(jnp.float32)) * ct.astype(jnp.float32))
    return value + sj.load_balancing_loss(r.router_probs, r.expert_ids), stats

  fwd = jax.jit(lambda *a: layer(*a)[:2])
  fwdbwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4), has_aux=True))
  return jax.jit(routing), fwd, fwdbwd


def reference(x, expert_ids, combine_weights, w_in, w_out, capacity: int | None):
  """y[t] = sum_j keep[t, j] w[t, j] FFN_{e[t, j]}(x[t]) in float32, on the expert-sorted batch."""
  E = w_in.shape[0]
  ids = np.asarray(expert_ids).reshape(-1)
  keep = np.ones_like(ids, bool) if capacity is None else np.asarray(
      jax.jit(capacity_keep_mask_reference, static_argnums=(1, 2))(expert_ids, E, capacity)).reshape(-1)
  keep = keep & (ids >= 0) & (ids < E)  # NO_EXPERT slots (token rounding's) are not assignments
  order = np.argsort(np.where(keep, ids, E), kind="stable")[: int(keep.sum())]
  counts = np.bincount(ids[order], minlength=E)
  cmax = max(1, int(counts.max()))
  starts = np.cumsum(counts) - counts
  pos = ids[order] * cmax + np.arange(len(order)) - starts[ids[order]]
  return _reference(x, order // expert_ids.shape[1], pos, order, keep, combine_weights, w_in, w_out,
                    E * cmax)


@functools.partial(jax.jit, static_argnums=8)
def _reference(x, token, pos, order, keep, combine_weights, w_in, w_out, buf_rows):
  T, k = combine_weights.shape
  E, d = w_in.shape[0], x.shape[1]
  f32 = lambda a: a.astype(jnp.float32)
  buf = jnp.zeros((buf_rows, d), jnp.float32).at[pos].set(f32(x)[token]).reshape(E, -1, d)
  mm = lambda a, w: jnp.einsum("eck,ekm->ecm", a, w, precision=HIGHEST)
  out = mlp(mm, buf, f32(w_in), f32(w_out)).reshape(-1, d)[pos]
  per_assignment = jnp.zeros((T * k, d), jnp.float32).at[order].set(out)
  w = jnp.where(keep, f32(combine_weights).reshape(-1), 0.0)
  return jnp.sum((per_assignment * w[:, None]).reshape(T, k, d), axis=1)


def bench(s: Shape, label: str, timer) -> dict:
  """One layer variant on one shape: check, then time forward and forward+backward."""
  impl, cf = parse_variant(label)
  resolved = resolve_impl(impl) if cf is None else "einsum"
  rec = dict(shape=s.name, variant=label, T=s.T, d=s.d, f=s.f, E=s.E, k=s.k, skewed=s.skewed,
             impl=resolved, capacity_factor=cf)
  if resolved in BLOCK_IMPLS:
    rec["backend"] = resolve_backend("auto" if resolved == "pallas" else resolved)
  a = inputs(s)
  rounded = label == "rounded"
  routing, fwd, fwdbwd = functions(s, impl, cf, rounded)
  args = (a["x"], a["bias"], a["w_r"], a["w_in"], a["w_out"])
  y, stats = fwd(*args)
  r = routing(*args[:3])
  cap = None if cf is None else sj.capacity(s.T, s.E, s.k, cf)
  rec["rel_err"] = rel_err(y, reference(a["x"], r.expert_ids, r.combine_weights, a["w_in"],
                                        a["w_out"], cap))
  rec["check_ok"] = bool(rec["rel_err"] < OUT_TOL)
  rec["dropped_fraction"] = float(stats.dropped_fraction)
  if rounded:  # rounded_moe_mlp's dropped_fraction counts what rounding dropped
    rec["added_fraction"] = float(np.sum(np.asarray(r.expert_ids)[:, s.k] >= 0)) / s.N
  (_, _), grads = fwdbwd(*args, a["ct"])
  rec["grads_finite"] = bool(all(bool(jnp.all(jnp.isfinite(g))) for g in grads))
  rec["check_ok"] = rec["check_ok"] and rec["grads_finite"]
  useful = int(jnp.sum(stats.tokens_per_expert)) - int(stats.num_dropped)
  tf = timer(lambda: fwd(*args), jax.block_until_ready)
  tb = timer(lambda: fwdbwd(*args, a["ct"]), jax.block_until_ready)
  rec.update(useful_rows=useful,
             fwd_ms=tf["median_s"] * 1e3, fwd_tflops=4 * useful * s.d * s.f / tf["median_s"] / 1e12,
             fwdbwd_ms=tb["median_s"] * 1e3,
             fwdbwd_tflops=12 * useful * s.d * s.f / tb["median_s"] / 1e12,
             tokens_per_s=s.T / tb["median_s"], fwd_timing=tf, fwdbwd_timing=tb)
  return rec


def profile(s: Shape, label: str, dest: str, calls: int = 5) -> list[str]:
  """A jax.profiler trace of `calls` forward+backward steps of one layer variant, its files copied
  flat into dest (profile_<shape>_<label>.*), and a per-op time summary printed and saved."""
  impl, cf = parse_variant(label)
  a = inputs(s)
  _, _, fwdbwd = functions(s, impl, cf)
  args = (a["x"], a["bias"], a["w_r"], a["w_in"], a["w_out"], a["ct"])
  for _ in range(2):
    jax.block_until_ready(fwdbwd(*args))
  tmp = tempfile.mkdtemp(prefix="moe_profile_")
  with jax.profiler.trace(tmp, create_perfetto_trace=True):
    for _ in range(calls):
      out = fwdbwd(*args)
    jax.block_until_ready(out)
  os.makedirs(dest, exist_ok=True)
  stem = os.path.join(dest, f"profile_{s.name}_{label}")
  written = []
  for root, _, files in os.walk(tmp):
    for name in files:
      if name.endswith(".xplane.pb"):  # for TensorBoard / xprof
        ext = ".xplane.pb"
      elif name == "perfetto_trace.json.gz":  # for ui.perfetto.dev
        ext = ".perfetto.json.gz"
      else:  # <host>.trace.json.gz holds the same events again
        continue
      shutil.copy(os.path.join(root, name), stem + ext)
      written.append(stem + ext)
  shutil.rmtree(tmp, ignore_errors=True)
  trace = stem + ".perfetto.json.gz"
  if os.path.exists(trace):
    lines = summarize_trace(trace, calls)
    with open(stem + ".txt", "w") as fh:
      fh.write("\n".join(lines) + "\n")
    written.append(stem + ".txt")
    print("\n".join(lines), flush=True)
  return written


def trace_device_times(path: str):
  """From a Chrome/Perfetto trace: ({line: {name: us}}, {line: {name: count}}, the GPU kernels
  sorted by start, whether a GPU was traced). Lines: on a GPU, "XLA Ops" (one event per HLO op)
  and "GPU kernels (all streams)"; elsewhere "CPU events", every event of the CPU device (nested
  ones counted in each)."""
  import gzip
  import json
  from collections import defaultdict

  with gzip.open(path, "rt") as fh:
    events = json.load(fh)
  events = events.get("traceEvents", []) if isinstance(events, dict) else events
  meta = lambda kind: {(e.get("pid"), e.get("tid")) if kind == "thread_name" else e.get("pid"):
                       e.get("args", {}).get("name", "") for e in events
                       if e.get("ph") == "M" and e.get("name") == kind}
  procs, threads = meta("process_name"), meta("thread_name")
  busy = {e.get("pid") for e in events if e.get("ph") == "X"}  # jax 0.11 names an idle GPU in a CPU trace
  gpu = {pid for pid, n in procs.items() if "GPU" in n and pid in busy}
  pids = gpu or {pid for pid, n in procs.items() if "CPU" in n}

  def line(e):
    if not gpu:
      return "CPU events"
    name = threads.get((e.get("pid"), e.get("tid")), "")
    return "GPU kernels (all streams)" if name.startswith("Stream") else name

  total = defaultdict(lambda: defaultdict(float))
  count = defaultdict(lambda: defaultdict(int))
  kernels = []
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in pids:
      g = line(e)
      total[g][e["name"]] += float(e.get("dur", 0.0))
      count[g][e["name"]] += 1
      if gpu and g == "GPU kernels (all streams)":
        kernels.append(e)
  return total, count, sorted(kernels, key=lambda e: float(e["ts"])), bool(gpu)


def summarize_trace(path: str, calls: int, top: int = 20) -> list[str]:
  """Device time per call by name (trace_device_times' lines: on a GPU the HLO ops and the
  streams' kernels, each on its own, since they overlap), then the kernels' timeline."""
  total, count, kernels, gpu = trace_device_times(path)
  sections = [g for g in ("XLA Ops", "GPU kernels (all streams)") if g in total] or list(total)
  lines = []
  for g in sections:
    all_us = sum(total[g].values())
    lines.append(f"{g}: {all_us / calls / 1e3:.3f} ms per call ({calls} calls)")
    for name, us in sorted(total[g].items(), key=lambda kv: -kv[1])[:top]:
      lines.append(f"  {us / calls / 1e3:9.3f} ms {100 * us / max(all_us, 1e-9):5.1f}%  "
                   f"x{count[g][name] / calls:<5.3g} {name[:110]}")
  if gpu:
    lines += kernel_timeline(kernels, calls)
  return lines


def kernel_timeline(kernels: list[dict], calls: int, min_us: float = 10.0) -> list[str]:
  """The kernels' span per call against the time some kernel runs (the rest is the GPU idle:
  launch gaps, host waits), and the last call's kernels in launch order (those of min_us or more,
  and every gap of 5 us or more): which of several same-named kernels (the Mosaic GPU calls) takes
  what. Calls are told apart by count: each launches the same kernels."""
  if not kernels:
    return []
  busy, end = 0.0, None
  for e in kernels:  # the union of the kernels' intervals (streams may overlap)
    t0, t1 = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
    if end is None or t0 > end:
      busy += t1 - t0
      end = t1
    elif t1 > end:
      busy += t1 - end
      end = t1
  span = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in kernels) - float(kernels[0]["ts"])
  lines = [f"Span of the {calls} calls' kernels: {span / calls / 1e3:.3f} ms per call, some kernel running "
           f"{busy / calls / 1e3:.3f}, GPU idle {(span - busy) / calls / 1e3:.3f}"]
  last = kernels[-(len(kernels) // calls):]
  t_start, prev_end = float(last[0]["ts"]), float(last[0]["ts"])
  lines.append(f"The last call's kernels in order ({len(last)} kernels; those of {min_us:g} us or more, "
               "and gaps of 5 us or more), start offset and duration in us:")
  for e in last:
    t0, dur = float(e["ts"]), float(e.get("dur", 0.0))
    if t0 - prev_end >= 5.0:
      lines.append(f"  {prev_end - t_start:9.1f}  {t0 - prev_end:8.1f}  (idle)")
    if dur >= min_us:
      lines.append(f"  {t0 - t_start:9.1f}  {dur:8.1f}  {e['name'][:100]}")
    prev_end = max(prev_end, t0 + dur)
  return lines
