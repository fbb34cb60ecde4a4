"""The dropless expert MLP and the whole MoE layer against their peers, on one GPU, in one process.

Expert MLP, y = gelu(x W_in[e]) W_out[e] on the N = T*k routed rows, bf16 (peers in experiments/peers/):
  sparsejax_pallas      sparsejax.expert_ffn on the 128-row padded layout, impl="pallas": what
                        moe_mlp's "auto" runs on this GPU (the record's `backend` names it)
  sparsejax_mosaic/_triton  one kernel backend each (a copy marked same_as where it is the above)
  balanced_bmm          XLA batched einsum on E equal groups of N/E rows: the ceiling
  capacity_einsum_cf*   XLA batched einsum on the capacity buffer (overflow dropped)
  ragged_dot            jax.lax.ragged_dot on the sorted rows
  torch_grouped_mm      torch._grouped_mm (CUTLASS), in this process, through DLPack
  jax_ragged_dot_mgpu   JAX's Mosaic GPU ragged_dot example, forward only, its configs tuned here
XLA peers are plain bf16 einsums / ragged_dots (float32 accumulation inside the matmul, bf16 out,
and a bf16 backward). Every variant is first checked against a float32 reference: the forward
output and the gradients in the rows, W_in and W_out (relative errors recorded; a failed check is
marked in the record and the table). Inputs are random normal, never zeros.
Whole layer (experiments/peers/layer.py): routing, placement, experts and combine, forward and
forward+backward, dropless (impl="auto") against the capacity-1.0 layer.

Useful TFLOP/s: forward 4*N*d*f, forward+backward 12*N*d*f, with N the rows actually computed
(padding not counted, dropped rows not counted).

Timing (peers/common.py Timer, the same for JAX and torch): after two synchronized warm-up calls,
the number of back-to-back asynchronous calls `iters` is grown until `iters` calls followed by one
sync (jax.block_until_ready; torch.cuda.synchronize) last at least 20 ms; a call's time is the
median over 7 such repeats of (repeat wall time) / iters. Host launch overhead is hidden as long
as the host enqueues a call faster than the GPU runs one (tens of microseconds against calls of
half a millisecond or more here), and the one sync is amortized over >= 20 ms. The JSON keeps
each timing's min, max and iters beside the median; the table shows the medians.

Writes experiments/results/moe_layer_<gpu>.{json,md,png} (…_smoke.* with --smoke), copied to $OUT
when set; the JSON and table are rewritten after each record. Runs that must fit a time limit are
split by shape (or by --variants) and joined with --merge. --profile only traces the layer
variants' forward+backward on the first shape: per variant a .xplane.pb (xprof / TensorBoard), a
.perfetto.json.gz (ui.perfetto.dev) and a .txt of device time per op and per kernel.

  python experiments/bench_moe_layer.py                                   # all four shapes
  python experiments/bench_moe_layer.py --shapes E64_top1,E64_top1_skewed
  python experiments/bench_moe_layer.py --shapes E8_top2,E64_top8 --merge
  python experiments/bench_moe_layer.py --variants sparsejax_pallas,sparsejax_triton --merge
  python experiments/bench_moe_layer.py --profile --shapes E64_top1       # traces of the layers
  python experiments/bench_moe_layer.py --smoke                           # tiny, on the CPU too
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import sys
import time

# torch shares the GPU with JAX in this process: JAX allocates on demand, up to a share of it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")

import jax  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from sparsejax.kernels.gmm import mosaic, resolve_backend, triton  # noqa: E402

from peers import common, layer, ragged_dot_mgpu, sparsejax_variants, torch_grouped_mm, xla  # noqa: E402
from peers.common import Shape  # noqa: E402
from provenance import source_fingerprint  # noqa: E402

SHAPES = [
    Shape("E64_top1", 16384, 1024, 4096, 64, 1, False),
    Shape("E64_top1_skewed", 16384, 1024, 4096, 64, 1, True),
    Shape("E8_top2", 16384, 2048, 8192, 8, 2, False),
    Shape("E64_top8", 8192, 2048, 1024, 64, 8, False),
]
# Mosaic GPU's interpret mode takes tens of seconds per product on a CPU: smoke shapes stay tiny.
SMOKE_SHAPES = [Shape("smoke", 256, 128, 256, 4, 2, False), Shape("smoke_skewed", 256, 128, 256, 4, 1, True)]
# Each capacity factor is one more XLA compile with GEMM autotuning (~20 s a shape on an H100):
# 1.0 by default, --capacity-factors 1.0,1.25,2.0 for the others.
CAPACITY_FACTORS = (1.0,)
LAYER_VARIANTS = ("dropless", "capacity_1.0")
SPARSEJAX = ("sparsejax_pallas", "sparsejax_mosaic", "sparsejax_triton", "sparsejax_mosaic_unfused")
PEERS = ("torch_grouped_mm", "balanced_bmm", "jax_ragged_dot_mgpu", "ragged_dot")


def log(*a):
  print(*a, flush=True)


def cc_major() -> str | None:
  if jax.default_backend() != "gpu":
    return None
  return str(getattr(jax.devices()[0], "compute_capability", ""))[:1]


def plan(p: common.Problem, ref: common.Reference, args, timer) -> list[tuple[str, object]]:
  """(variant, builder of its Case | reason it is skipped | ("same_as", variant)) in run order.
  torch first: JAX's allocator keeps what it grows to, so torch takes its memory before."""
  on_gpu = jax.default_backend() == "gpu"
  steps = []
  reason = "--no-torch" if args.no_torch else torch_grouped_mm.unavailable()
  steps.append(("torch_grouped_mm", reason or (lambda: torch_grouped_mm.torch_grouped_mm(p, ref))))
  steps.append(("balanced_bmm", lambda: xla.balanced_bmm(p, ref)))
  for cf in args.capacity_factors:
    steps.append((f"capacity_einsum_cf{cf}", lambda cf=cf: xla.capacity_einsum(p, ref, cf)))
  auto = resolve_backend("auto")
  steps.append(("sparsejax_pallas", lambda: sparsejax_variants.sparsejax_case(p, ref, "pallas")))
  for backend in ("mosaic", "triton"):
    name = f"sparsejax_{backend}"
    if backend == auto and (not args.variants or "sparsejax_pallas" in args.variants):
      steps.append((name, ("same_as", "sparsejax_pallas")))
    elif backend == "mosaic" and on_gpu and cc_major() != "9":
      steps.append((name, f"Mosaic GPU kernels need sm_90; this GPU is sm_{cc_major()}x"))
    elif backend == "mosaic" and not on_gpu and not args.smoke_mosaic:
      steps.append((name, "Mosaic GPU interpret mode is too slow for a CPU run (--smoke-mosaic runs it)"))
    else:
      steps.append((name, lambda b=backend: sparsejax_variants.sparsejax_case(p, ref, b)))
  if (on_gpu and cc_major() == "9") or (not on_gpu and args.smoke_mosaic):
    steps.append(("sparsejax_mosaic_unfused",
                  lambda: sparsejax_variants.sparsejax_case(p, ref, "mosaic_unfused")))
  else:
    steps.append(("sparsejax_mosaic_unfused", "needs the Mosaic GPU kernels (sm_90, or --smoke-mosaic)"))
  reason = ragged_dot_mgpu.unavailable()
  steps.append(("jax_ragged_dot_mgpu", reason or (
      lambda: ragged_dot_mgpu.ragged_dot_mgpu(p, ref, timer, args.mgpu_configs))))
  steps.append(("ragged_dot", lambda: xla.ragged_dot(p, ref)))
  if args.variants:
    steps = [s for s in steps if s[0] in args.variants]
  return steps


def base_record(s: Shape, variant: str) -> dict:
  return dict(shape=s.name, variant=variant, T=s.T, d=s.d, f=s.f, E=s.E, k=s.k, skewed=s.skewed,
              time=datetime.datetime.now().isoformat(timespec="seconds"))


def run_case(s: Shape, variant: str, build, timer, done: dict) -> dict:
  rec = base_record(s, variant)
  if isinstance(build, str):
    rec["skipped"] = build
    log(f"{variant:26s} skipped: {build}")
    return rec
  if isinstance(build, tuple):  # ("same_as", other): the same program as a record already made
    other = done.get(build[1])
    if other is None:
      rec["skipped"] = f"same program as {build[1]}, which did not run"
    else:
      rec.update({k: v for k, v in other.items() if k not in ("variant", "time")}, same_as=build[1])
    log(f"{variant:26s} = {build[1]}")
    return rec
  t0 = time.perf_counter()
  try:
    case = build()
    rec.update(case.info)
    rec.update(case.check())
    tf = timer(case.fwd, case.sync)
    n = case.useful_rows
    rec.update(useful_rows=n, fwd_ms=tf["median_s"] * 1e3,
               fwd_tflops=4 * n * s.d * s.f / tf["median_s"] / 1e12, fwd_timing=tf)
    if case.fwdbwd is not None:
      tb = timer(case.fwdbwd, case.sync)
      rec.update(fwdbwd_ms=tb["median_s"] * 1e3,
                 fwdbwd_tflops=12 * n * s.d * s.f / tb["median_s"] / 1e12, fwdbwd_timing=tb)
    grad = max(rec.get("grad_rel_err") or [float("nan")])
    log(f"{variant:26s} fwd {_fmt(rec['fwd_tflops'])} TF/s  fwd+bwd {_fmt(rec.get('fwdbwd_tflops'))} TF/s  "
        f"err {rec['rel_err']:.1e} grad {grad:.1e}" + ("" if rec["check_ok"] else "  CHECK FAILED")
        + (f"  dropped {rec['dropped_fraction']:.3f}" if "dropped_fraction" in rec else ""))
  except Exception as e:  # noqa: BLE001 - an OOM or a failing config is a result too
    rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    log(f"{variant:26s} FAILED {rec['error'][:300]}")
  rec["bench_wall_s"] = round(time.perf_counter() - t0, 2)
  return rec


def bench_mlp(s: Shape, args, timer, out: list, save) -> None:
  """Append one record per expert-MLP variant to out, calling save() after each."""
  log(f"\n=== {s.name}: T={s.T} d={s.d} f={s.f} E={s.E} k={s.k} skewed={s.skewed}")
  p = common.make_problem(s)
  log(f"rows per expert: min {p.counts.min()} max {p.counts.max()} mean {p.counts.mean():.0f}")
  ref = common.dropless_reference(p)
  done = {}
  for variant, build in plan(p, ref, args, timer):
    done[variant] = run_case(s, variant, build, timer, done)
    if variant == "torch_grouped_mm" and callable(build):
      torch_grouped_mm.release()
    out.append(done[variant])
    save()


def bench_layer(s: Shape, args, timer, out: list, save) -> None:
  """Append one record per whole-layer variant to out, calling save() after each."""
  for label in args.layer_variants:
    t0 = time.perf_counter()
    try:
      rec = layer.bench(s, label, timer)
      log(f"layer {label:16s} fwd+bwd {rec['fwdbwd_ms']:8.3f} ms  fwd {rec['fwd_ms']:8.3f} ms  "
          f"dropped {rec['dropped_fraction']:.3f}  err {rec['rel_err']:.1e}"
          + ("" if rec["check_ok"] else "  CHECK FAILED"))
    except Exception as e:  # noqa: BLE001
      rec = base_record(s, label) | {"error": f"{type(e).__name__}: {str(e)[:400]}"}
      log(f"layer {label} FAILED {rec['error'][:300]}")
    rec.setdefault("time", datetime.datetime.now().isoformat(timespec="seconds"))
    rec["bench_wall_s"] = round(time.perf_counter() - t0, 2)
    out.append(rec)
    save()


# ----------------------------------------------------------------------------------------------
# Output: JSON, markdown, plot.
# ----------------------------------------------------------------------------------------------
def _fmt(v, spec="6.1f"):
  """A number for the table ("—" when absent or NaN); TFLOP/s under 1 (smoke runs) keep 3 digits."""
  if not isinstance(v, (int, float)) or v != v:
    return "—"
  return format(v, ".3g" if spec == "6.1f" and abs(v) < 1 else spec)


def _key(r):
  return r["shape"], r.get("variant", r.get("layer"))


def merge_previous(results: dict, path: str) -> dict:
  """Keep the earlier records of (shape, variant) pairs this run did not measure."""
  if not os.path.exists(path):
    return results
  with open(path) as fh:
    old = json.load(fh)
  for key in ("mlp", "layer"):
    now = {_key(r) for r in results[key]}
    results[key] = [r for r in old.get(key, []) if _key(r) not in now] + results[key]
  return results


def find(records, shape, variant):
  return next((r for r in records if r["shape"] == shape and r["variant"] == variant), None)


def ratio(a, b, field):
  x, y = (a or {}).get(field), (b or {}).get(field)
  return x / y if x and y else None


def markdown(results: dict) -> str:
  mlp = results["mlp"]
  lines = [f"# MoE expert MLP and layer on {results['gpu']}", "",
           f"jax {results['jax']}, torch {results.get('torch') or '—'}, bf16. Useful TFLOP/s (fwd 4Ndf, "
           "fwd+bwd 12Ndf, N real rows); ms are medians (experiments/bench_moe_layer.py docstring). "
           "Ratios are fwd+bwd TFLOP/s of the sparsejax row over the peer; 'fwd ÷ mgpu' is the "
           "forward over jax_ragged_dot_mgpu's best config.", "",
           "| shape | variant | backend / config | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd ms | fwd+bwd ms "
           "| ÷ torch | ÷ balanced | fwd ÷ mgpu | dropped | rel err (y / grads) | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for shape in dict.fromkeys(r["shape"] for r in mlp):
    torch_r, bal, mgpu = (find(mlp, shape, v) for v in ("torch_grouped_mm", "balanced_bmm",
                                                        "jax_ragged_dot_mgpu"))
    for r in (r for r in mlp if r["shape"] == shape):
      sj_row = r["variant"] in SPARSEJAX
      cfg = r.get("backend") or ""
      if isinstance(r.get("config"), dict):
        cfg = "; ".join(f"{op} {list(c.values())}" for op, c in r["config"].items())
      grads = r.get("grad_rel_err")
      err = (_fmt(r.get("rel_err"), ".1e") + (" / " + _fmt(max(grads), ".1e") if grads else "")
             if "rel_err" in r else "")
      note = r.get("skipped") or r.get("error", "")[:80]
      if r.get("check_ok") is False:
        note = "CHECK FAILED " + note
      if r.get("same_as"):
        note = f"same program as {r['same_as']}"
      rt = lambda peer, field="fwdbwd_tflops": _fmt(ratio(r, peer, field), ".2f") if sj_row else ""
      lines.append(
          f"| {shape} | {r['variant']} | {cfg} | {_fmt(r.get('fwd_tflops'))} | {_fmt(r.get('fwdbwd_tflops'))} "
          f"| {_fmt(r.get('fwd_ms'), '.3f')} | {_fmt(r.get('fwdbwd_ms'), '.3f')} | {rt(torch_r)} | {rt(bal)} "
          f"| {rt(mgpu, 'fwd_tflops')} | {_fmt(r.get('dropped_fraction'), '.3f') if 'dropped_fraction' in r else ''} "
          f"| {err} | {note} |")
  lay = results.get("layer", [])
  if lay:
    lines += ["", "Whole layer (routing, placement, experts, combine), forward+backward; 'speed ÷ capacity "
              "1.0' is the capacity-1.0 layer's time over this one's (≥ 1: dropless for free).", "",
              "| shape | layer | impl | fwd+bwd ms | fwd ms | tokens/s | fwd+bwd TFLOP/s | dropped "
              "| speed ÷ capacity 1.0 | rel err | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in lay:
      cap = find(lay, r["shape"], "capacity_1.0")
      speed = (cap["fwdbwd_ms"] / r["fwdbwd_ms"] if cap and cap.get("fwdbwd_ms") and r.get("fwdbwd_ms")
               else None)
      impl = r.get("impl", "") + (f" ({r['backend']})" if r.get("backend") else "")
      note = r.get("error", "")[:80] + ("" if r.get("check_ok", True) else " CHECK FAILED")
      if "added_fraction" in r:
        note += f" rounding added {r['added_fraction']:.3f}"
      lines.append(
          f"| {r['shape']} | {r['variant']} | {impl} | {_fmt(r.get('fwdbwd_ms'), '.3f')} "
          f"| {_fmt(r.get('fwd_ms'), '.3f')} | {_fmt(r.get('tokens_per_s'), '.3g')} "
          f"| {_fmt(r.get('fwdbwd_tflops'))} | {_fmt(r.get('dropped_fraction'), '.3f')} "
          f"| {_fmt(speed, '.2f') if r['variant'] != 'capacity_1.0' else ''} | {_fmt(r.get('rel_err'), '.1e')} "
          f"| {note} |")
  lines += ["", *targets(results)]
  return "\n".join(lines) + "\n"


def targets(results: dict) -> list[str]:
  """The issue's targets for sparsejax_pallas, one line per shape."""
  mlp, lay = results["mlp"], results.get("layer", [])
  out = ["Targets (sparsejax_pallas): fwd+bwd ≥ 1.0× torch (≥ 1.15× on the E64 top-1 shapes), "
         "≥ 0.95× balanced_bmm, fwd ≥ best jax_ragged_dot_mgpu, dropless layer ≥ capacity-1.0 layer.", "",
         "| shape | ÷ torch | ÷ balanced | fwd ÷ mgpu | layer speed ÷ capacity | all met |", "|---|---|---|---|---|---|"]
  # A --layer-only run has no MLP records: its shapes come from the layer, its MLP cells read "—", and
  # "all met" judges only what the run measured.
  for shape in dict.fromkeys([r["shape"] for r in mlp] + [r["shape"] for r in lay]):
    sj_r = find(mlp, shape, "sparsejax_pallas")
    want_torch = 1.15 if shape.startswith("E64_top1") else 1.0
    drop, cap = find(lay, shape, "dropless"), find(lay, shape, "capacity_1.0")
    vals = [(ratio(sj_r, find(mlp, shape, "torch_grouped_mm"), "fwdbwd_tflops"), want_torch),
            (ratio(sj_r, find(mlp, shape, "balanced_bmm"), "fwdbwd_tflops"), 0.95),
            (ratio(sj_r, find(mlp, shape, "jax_ragged_dot_mgpu"), "fwd_tflops"), 1.0),
            (ratio(cap, drop, "fwdbwd_ms"), 1.0)]
    cells = [("—" if v is None else f"{v:.2f} {'✓' if v >= want else '✗'}") for v, want in vals]
    measured = [(v, want) for v, want in vals if v is not None]
    met = "no" if any(v < want for v, want in measured) else "yes" if len(measured) == len(vals) else \
        "yes, of those measured" if measured else "—"
    out.append(f"| {shape} | {' | '.join(cells)} | {met} |")
  return out


def plot(results: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  def bars(ax, records, field):
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    variants = [v for v in dict.fromkeys(r["variant"] for r in records)
                if any(r.get(field) for r in records if r["variant"] == v and not r.get("same_as"))]
    w = 0.8 / max(1, len(variants))
    for vi, v in enumerate(variants):
      ax.bar(np.arange(len(shapes)) + vi * w, [(find(records, s, v) or {}).get(field) or 0 for s in shapes], w, label=v)
    ax.set_xticks(np.arange(len(shapes)) + 0.4 - w / 2, shapes, fontsize=8)
    ax.legend(fontsize=7)

  # Panels for what the run measured: the MLP's two (absent under --layer-only) and the layer's time.
  panels = [(results["mlp"], "fwd_tflops", "expert MLP forward", "useful TFLOP/s"),
            (results["mlp"], "fwdbwd_tflops", "expert MLP forward+backward", "useful TFLOP/s"),
            (results.get("layer", []), "fwdbwd_ms", "whole layer forward+backward", "ms (lower is faster)")]
  panels = [p for p in panels if p[0]]
  fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(7.5 * max(1, len(panels)), 5), squeeze=False)
  for ax, (records, field, title, unit) in zip(axes[0], panels):
    bars(ax, records, field)
    ax.set_title(f"{title}, bf16, {results['gpu']}", fontsize=9)
    ax.set_ylabel(unit)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_outputs(results: dict, stem: str, merge: bool, with_plot: bool = True) -> str:
  os.makedirs(os.path.dirname(stem), exist_ok=True)
  if merge:
    results = merge_previous(results, stem + ".json")
  with open(stem + ".json", "w") as fh:
    json.dump(results, fh, indent=1)
  table = markdown(results)
  with open(stem + ".md", "w") as fh:
    fh.write(table)
  try:
    if with_plot:
      plot(results, stem + ".png")
  except Exception as e:  # noqa: BLE001 - the JSON and the table matter more than the picture
    log(f"plot failed: {type(e).__name__}: {e}")
  copy_to_out([stem + ext for ext in (".json", ".md", ".png")])
  return table


def copy_to_out(paths) -> None:
  out = os.environ.get("OUT")
  for path in paths:
    if out and os.path.exists(path) and os.path.realpath(os.path.dirname(path)) != os.path.realpath(out):
      shutil.copy(path, out)


def parse_args(argv):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--smoke", action="store_true", help="tiny shapes, fast timer; runs on the CPU")
  ap.add_argument("--shapes", default="all", help="comma-separated shape names")
  ap.add_argument("--variants", default="", help="comma-separated expert-MLP variants (default: all)")
  ap.add_argument("--capacity-factors", default=",".join(map(str, CAPACITY_FACTORS)))
  ap.add_argument("--layer-variants", default=",".join(LAYER_VARIANTS),
                  help="dropless, dropless_<impl>, capacity_<cf>, rounded (token rounding); empty for none")
  ap.add_argument("--mgpu-configs", default="",
                  help="ragged_dot_mgpu configs 'bm,bn,bk,steps,gbn;...' (default: peers/ragged_dot_mgpu.py)")
  ap.add_argument("--no-torch", action="store_true")
  ap.add_argument("--merge", action="store_true", help="keep earlier records of (shape, variant) not run now")
  ap.add_argument("--layer-only", action="store_true", help="time only the whole layer")
  ap.add_argument("--profile", action="store_true",
                  help="only trace each --layer-variants layer's fwd+bwd on the first shape "
                       "(3 files each, into $OUT or --out-dir)")
  ap.add_argument("--smoke-mosaic", action="store_true", help="with --smoke on a CPU, run the Mosaic backend too (in interpret mode; jax 0.10.2's "
                       "interpreter stops on it with a TransposeTransform error: "
                       "tests/test_gmm_kernels.py interprets the kernels with configs it handles)")
  ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
  args = ap.parse_args(argv)
  shapes = SMOKE_SHAPES if args.smoke else SHAPES
  if args.shapes != "all":
    names = args.shapes.split(",")
    unknown = set(names) - {s.name for s in shapes}
    if unknown:
      ap.error(f"unknown shapes {sorted(unknown)}; choose from {[s.name for s in shapes]}")
    shapes = [s for s in shapes if s.name in names]
  args.shape_list = shapes
  args.variants = [v for v in args.variants.split(",") if v]
  try:
    args.capacity_factors = [float(c) for c in args.capacity_factors.split(",") if c]
    for v in args.variants:  # a capacity variant named in --variants runs with its factor
      if v.startswith("capacity_einsum_cf") and float(v[len("capacity_einsum_cf"):]) not in args.capacity_factors:
        args.capacity_factors.append(float(v[len("capacity_einsum_cf"):]))
  except ValueError:
    ap.error("capacity factors are numbers: --capacity-factors 1.0,1.25 / --variants capacity_einsum_cf1.25")
  unknown = [v for v in args.variants if v not in SPARSEJAX + PEERS and not v.startswith("capacity_einsum_cf")]
  if unknown:
    ap.error(f"unknown variants {unknown}; choose from {list(SPARSEJAX + PEERS)} or capacity_einsum_cf<cf>")
  args.layer_variants = [v for v in args.layer_variants.split(",") if v]
  for v in args.layer_variants:
    try:
      layer.parse_variant(v)
    except ValueError as e:
      ap.error(str(e))
  try:
    args.mgpu_configs = ([tuple(int(x) for x in c.split(",")) for c in args.mgpu_configs.split(";")]
                         if args.mgpu_configs else ragged_dot_mgpu.CONFIGS)
  except ValueError:
    ap.error("--mgpu-configs takes 'bm,bn,bk,steps,gbn;...' integers")
  if any(len(c) != 5 for c in args.mgpu_configs):
    ap.error("--mgpu-configs: each config has 5 integers")
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  dev = jax.devices()[0]
  gpu = dev.device_kind.replace(" ", "_").replace("/", "_") if dev.platform == "gpu" else "cpu"
  log(f"jax {jax.__version__} on {dev.device_kind}; pallas backend here: {resolve_backend('auto')}; "
      f"sparsejax source {source_fingerprint()}")
  if args.profile:
    dest = os.environ.get("OUT") or args.out_dir
    for label in args.layer_variants:
      files = layer.profile(args.shape_list[0], label, dest)
      log("profile written: " + ", ".join(os.path.basename(f) for f in files))
    return {}
  timer = common.SMOKE_TIMER if args.smoke else common.Timer()
  try:
    import torch
    torch_version = torch.__version__
  except ImportError:
    torch_version = None
  results = dict(
      gpu=gpu, device_kind=dev.device_kind, jax=jax.__version__, torch=torch_version,
      sparsejax_source=source_fingerprint(),
      timer=dataclasses.asdict(timer),
      env={k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")},
      mosaic_configs=dataclasses.asdict(mosaic.DEFAULT_CONFIGS),
      triton_tiling=dataclasses.asdict(triton.DEFAULT_TILING),
      mlp=[], layer=[])
  stem = os.path.join(args.out_dir, f"moe_layer_{gpu}" + ("_smoke" if args.smoke else ""))
  t0 = time.perf_counter()
  # The JSON and the table are rewritten after every record: a run stopped at a time limit
  # keeps everything it measured.
  save = lambda: write_outputs(dict(results), stem, args.merge, with_plot=False)
  for s in args.shape_list:
    if not args.layer_only:
      bench_mlp(s, args, timer, results["mlp"], save)
    bench_layer(s, args, timer, results["layer"], save)
    log(f"[{time.perf_counter() - t0:.0f} s so far]")
  table = write_outputs(results, stem, args.merge)
  log("\n" + table)
  return results


if __name__ == "__main__":
  main()
