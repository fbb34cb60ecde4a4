"""Activation rematerialization of the training step (TransformerConfig.remat): time and memory, one GPU.

Each mode ("none": the backward reads every activation the forward kept; "ffn": each feed-forward keeps only
its input and runs its forward again in the backward; "block": each block does) builds the library's own step
(bench_ep_train.build: init_model, make_optimizer, make_steps, one device, the forward on the compute-dtype copy)
for each --set group, from the same params and batches. Per mode: XLA's temp buffer and arguments (compiled
memory_analysis, GiB), the median step time of --repeats windows of --steps steps after --warmup, and step 0's
loss and gradient norm, which must equal the "none" mode's (the same forward, the same gradients up to the
order of float sums; checked, 1e-2 relative in bf16), and the loss after the last window (not checked: from step
0 on, bf16 rounding of the recomputed forward may flip a near-tied token's expert, and the runs drift apart).

  python experiments/bench_remat.py                          # xs-moe, 32 x 1024 tokens, top-1 and top-8
  python experiments/bench_remat.py --preset small-moe --groups top_k=1 --batch 16
  python experiments/bench_remat.py --smoke --out "$(mktemp -d)"  # CPU, a tiny model, two steps a window
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

if "--smoke" in sys.argv:
  os.environ["JAX_PLATFORMS"] = "cpu"
HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_ep_train import SMOKE_MODEL, build, compiled_memory, timed_windows  # noqa: E402
from out_dir import copy_to_out  # noqa: E402
from sparsejax.cli import parse_overrides  # noqa: E402
from sparsejax.data import load_corpus  # noqa: E402
from sparsejax.models.config import REMAT  # noqa: E402
from sparsejax.train import TrainConfig, free_device_bytes, state_bytes_per_device  # noqa: E402

TOLERANCE = 1e-2  # step 0's loss and gradient norm against the "none" mode's, relative (bf16)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="xs-moe")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--modes", default=",".join(REMAT), help="comma list of " + ", ".join(REMAT))
  p.add_argument("--groups", nargs="+", default=["top_k=1", "top_k=8"],
                 help="model overrides a group, FIELD=VALUE[;FIELD=VALUE]; each group runs every mode")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--tag", default="")
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--out", default=str(HERE / "results"))
  args = p.parse_args(argv)
  args.modes = args.modes.split(",")
  if bad := [m for m in args.modes if m not in REMAT]:
    p.error(f"--modes: unknown {bad}; pick from {', '.join(REMAT)}")
  args.group_overrides = [parse_overrides(g.split(";"), p) for g in args.groups]
  if args.smoke:
    args.preset, args.batch, args.seq_len, args.steps, args.repeats, args.warmup = "tiny-moe", 4, 32, 2, 1, 1
  return args


def measure(args, corpus, overrides: dict, mode: str) -> dict:
  ns = argparse.Namespace(smoke=args.smoke, preset=args.preset, batch_per_gpu=args.batch, seq_len=args.seq_len,
                          warmup=args.warmup, steps=args.steps, repeats=args.repeats, ragged_chunks=1,
                          overrides={**(SMOKE_MODEL if args.smoke else {}), **overrides, "remat": mode})
  cfg, _, train_step, (params, opt_state, copy), batches = build(ns, corpus, 1, None)
  t0 = time.perf_counter()
  compiled = train_step.lower(params, opt_state, *batches[0], jnp.int32(0), copy).compile()
  rec = {"mode": mode, "overrides": overrides, "compile_s": time.perf_counter() - t0,
         "memory_gib": compiled_memory(compiled)}
  state, metrics = [params, opt_state, copy], []

  def run(lo, hi):
    for i in range(lo, hi):
      state[0], state[1], m, state[2] = compiled(state[0], state[1], *batches[i], jnp.int32(i), state[2])
    jax.block_until_ready(state)
    metrics.append({k: float(m[k]) for k in ("loss", "grad_norm")})

  windows = timed_windows(run, args)
  step_s = statistics.median(windows)
  rec.update(step_ms=1e3 * step_s, windows_ms=[1e3 * w for w in windows],
             tokens_per_s=cfg.batch_size * cfg.seq_len / step_s, loss_0=metrics[0]["loss"],
             grad_norm_0=metrics[0]["grad_norm"], loss_last=metrics[-1]["loss"],
             losses=[m["loss"] for m in metrics])  # step 0's, then each warm-up's and window's last
  print(f"{overrides} remat={mode}: {rec['step_ms']:.2f} ms a step, memory (GiB) {rec['memory_gib']}, "
        f"step 0 loss {rec['loss_0']:.5f} grad norm {rec['grad_norm_0']:.5f}", flush=True)
  return rec


def check(records: list[dict]) -> list[str]:
  """Each mode's step 0 against the first mode's of its group: the forward and the gradients are the same math."""
  bad = []
  for r in records:
    base = next(b for b in records if b["overrides"] == r["overrides"])
    for key in ("loss_0", "grad_norm_0"):
      if abs(r[key] - base[key]) > TOLERANCE * abs(base[key]):
        bad.append(f"{r['overrides']} remat={r['mode']}: {key} {r[key]:.6g} against {base[key]:.6g}")
  return bad


def _names(overrides: dict) -> str:
  return " ".join(f"{k}={v}" for k, v in overrides.items())


def markdown(report: dict) -> str:
  model = report["preset"]
  if report["smoke"]:
    model = f"smoke run: {model} shrunk to " + ", ".join(f"{k}={v}" for k, v in SMOKE_MODEL.items())
  lines = [f"### Training step by remat mode ({model}, {report['batch']} x {report['seq_len']} tokens, "
           f"{report['device']}, jax {report['jax']})", "",
           "| overrides | remat | step ms | tokens/s | temp GiB | arguments GiB | step 0 loss | step 0 grad norm | "
           "last loss |", "|---|---|---|---|---|---|---|---|---|"]
  for r in report["records"]:
    m = r["memory_gib"] or {}
    lines.append(f"| {_names(r['overrides'])} | {r['mode']} | {r['step_ms']:.2f} | "
                 f"{r['tokens_per_s']:.3g} | {m.get('temp', float('nan')):.2f} | "
                 f"{m.get('arguments', float('nan')):.2f} | "
                 f"{r['loss_0']:.5f} | {r['grad_norm_0']:.5f} | {r['loss_last']:.4f} |")
  lines += ["", f"Check (step 0 against remat=none, {TOLERANCE:g} relative): " +
            ("; ".join(report["mismatches"]) or "every mode agrees")]
  return "\n".join(lines)


def plot(report: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for r in report["records"]:
    if r["memory_gib"]:
      ax.scatter(r["memory_gib"]["temp"], r["step_ms"], label=f"{_names(r['overrides'])}, remat={r['mode']}")
  ax.set_xlabel("XLA temp buffer (GiB)")
  ax.set_ylabel("step (ms)")
  ax.set_title(f"remat modes, {report['preset']}, {report['device']}")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
  args = parse_args(argv)
  corpus = load_corpus(None)
  cfg = TrainConfig(preset=args.preset, model_overrides=SMOKE_MODEL if args.smoke else {})
  need, free = state_bytes_per_device(cfg, cfg.model_config()), free_device_bytes(jax.local_devices()[:1])
  if free is not None and need > free:  # else the allocator may retry for minutes (medium-moe on one H200 did)
    raise SystemExit(f"{args.preset}'s parameters and AdamW moments need {need / 2**30:.1f} GiB and "
                     f"{free / 2**30:.1f} GiB is free on one device: pick a smaller --preset.")
  records = [measure(args, corpus, o, mode) for o in args.group_overrides for mode in args.modes]
  device = jax.devices()[0].device_kind
  report = {"preset": args.preset, "smoke": args.smoke, "batch": args.batch, "seq_len": args.seq_len, "device": device,
            "jax": jax.__version__, "records": records, "mismatches": check(records)}
  text = markdown(report)
  print(text)
  name = f"remat_{device.replace(' ', '_')}{'_smoke' * args.smoke}{args.tag}"  # a smoke run never replaces a table
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{name}.json").write_text(json.dumps(report, indent=1))
  (out / f"{name}.md").write_text(text + "\n")
  plot(report, out / f"{name}.png")
  copy_to_out(*(out / f"{name}.{ext}" for ext in ("json", "md", "png")))
  if report["mismatches"]:
    raise SystemExit("remat modes disagree at step 0: " + "; ".join(report["mismatches"]))
  return report


if __name__ == "__main__":
  main()
