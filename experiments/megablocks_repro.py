"""MegaBlocks' claim on one GPU: at equal wall time, dropless MoE reaches a given loss sooner than
capacity-factor MoE (which drops tokens) and than the dense model of the same per-token FLOPs.

Trains, each for the same training-time budget (compile and evaluation excluded), an MoE-XS-sized
model (512 hidden, 8 layers, 64 experts top-1 in every layer, bf16) as
  dropless (moe_impl auto: the library's fastest path), capacity factor 1.0 / 1.5 / 2.0,
and the dense XS model (top-1 with d_ff-sized experts = the dense FLOPs). Records tokens/s, dropped
fraction and validation loss over wall time to experiments/results/megablocks*.json and plots
validation loss against wall time. The LR is warm-up then flat (the cosine horizon lies far past
the budget), so no variant gains from where its schedule ends.

  python experiments/megablocks_repro.py                 # GPU: 5 x 40 s budget, about 7 minutes
  python experiments/megablocks_repro.py --smoke         # CPU: tiny sizes, seconds each
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import shutil
import sys

import jax
import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
# plot.py beside this file, and this checkout's sparsejax ahead of any other installed copy.
sys.path[:0] = [str(_HERE), str(_HERE.parent)]
from plot import load_metrics  # noqa: E402

from sparsejax.train import TrainConfig, train  # noqa: E402

VARIANTS = {  # name: (preset, TransformerConfig overrides)
    "dropless": ("xs-moe", {}),
    "capacity 1.0": ("xs-moe", {"capacity_factor": 1.0}),
    "capacity 1.5": ("xs-moe", {"capacity_factor": 1.5}),
    "capacity 2.0": ("xs-moe", {"capacity_factor": 2.0}),
    "dense": ("xs-dense", {}),
}
SMOKE_MODEL = dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, num_experts=4, max_seq_len=64)


def time_to_reach(val: list[dict], target: float) -> float | None:
  """The first training time at which the validation loss is <= target (linearly interpolated)."""
  prev = None
  for r in val:
    if r["val_loss"] <= target:
      if prev is None:
        return r["elapsed_s"]
      f = (prev["val_loss"] - target) / (prev["val_loss"] - r["val_loss"])
      return prev["elapsed_s"] + f * (r["elapsed_s"] - prev["elapsed_s"])
    prev = r
  return None


def run_variant(name: str, preset: str, overrides: dict, args, runs: pathlib.Path) -> dict:
  out = runs / name.replace(" ", "_")
  shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resume
  model = {**(SMOKE_MODEL if args.smoke else {}), **overrides}
  if args.moe_impl:
    model["moe_impl"] = args.moe_impl
  cfg = TrainConfig(
      preset=preset, data=args.data, out=str(out), steps=10**7, batch_size=args.batch_size,
      seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, dtype=args.dtype, eval_every=0,
      eval_every_s=args.budget_s / args.evals, eval_batches=args.eval_batches, ckpt_every=0,
      log_every=args.log_every, max_time_s=args.budget_s, seed=args.seed, progress=not args.no_progress,
      model_overrides=model)
  print(f"\n=== {name}: {preset} {overrides} for {args.budget_s:.0f} s of training", flush=True)
  final = train(cfg)
  train_rows, val_rows = load_metrics(out)
  steady = [r["tokens_per_s"] for r in train_rows[1:]] or [r["tokens_per_s"] for r in train_rows]
  return {
      "preset": preset, "overrides": overrides, "steps": final["step"], "compile_s": final["compile_s"],
      "tokens_per_s": float(np.median(steady)), "mfu": final.get("mfu"),
      "dropped_fraction": float(np.mean([np.mean(r["dropped_fraction"] or [0.0]) for r in train_rows])),
      "final_val_loss": final["val_loss"],
      "val_curve": [{"elapsed_s": r["elapsed_s"], "step": r["step"], "val_loss": r["val_loss"]} for r in val_rows],
  }


def summarize(results: dict) -> dict:
  """The loss every variant reached (the worst of their best), and when each reached it."""
  target = max(min(p["val_loss"] for p in r["val_curve"]) for r in results.values())
  return {"target_val_loss": target,
          "time_to_target_s": {n: time_to_reach(r["val_curve"], target) for n, r in results.items()}}


def plot(results: dict, path: pathlib.Path, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, r in results.items():
    c = r["val_curve"]
    label = f"{name} ({r['tokens_per_s']:,.0f} tok/s, {100 * r['dropped_fraction']:.1f}% dropped)"
    ax.plot([p["elapsed_s"] for p in c], [p["val_loss"] for p in c], "o-", ms=3, label=label)
  ax.set(xlabel="training wall time (s)", ylabel="validation loss (nats/byte)", title=title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--budget-s", type=float, default=None, help="training seconds per variant (GPU default 40)")
  p.add_argument("--smoke", action="store_true", help="tiny model and budget: checks the script on a CPU")
  p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  p.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
  p.add_argument("--data", default=None, help="corpus (default: the Python standard library)")
  p.add_argument("--batch-size", type=int, default=None)
  p.add_argument("--seq-len", type=int, default=None)
  p.add_argument("--lr", type=float, default=6e-4)
  p.add_argument("--warmup", type=int, default=100)
  p.add_argument("--dtype", default=None, help="compute dtype (default bfloat16 on GPU)")
  p.add_argument("--moe-impl", default=None, help="grouped-matmul backend for MoE layers (default auto)")
  p.add_argument("--evals", type=int, default=10, help="validation points per run")
  p.add_argument("--eval-batches", type=int, default=4)
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--merge", action="store_true",
                 help="keep the other variants of an existing results file (run the variants in parts)")
  args = p.parse_args(argv)
  if args.smoke:
    defaults = dict(budget_s=2.0, batch_size=4, seq_len=32, warmup=5, log_every=2)
    args.lr = 3e-3
  else:
    defaults = dict(budget_s=40.0, batch_size=32, seq_len=1024, log_every=args.log_every)
  for k, v in defaults.items():
    if getattr(args, k) is None or (args.smoke and k in ("warmup", "log_every")):
      setattr(args, k, v)

  out = pathlib.Path(args.out)
  runs = out / ("runs_smoke" if args.smoke else "runs")
  stem = "megablocks_smoke" if args.smoke else "megablocks"
  results_path = out / f"{stem}.json"
  results = {}
  if args.merge and results_path.exists():
    results = json.loads(results_path.read_text())["variants"]
  for name in args.variants:
    preset, overrides = VARIANTS[name]
    results[name] = run_variant(name, preset, overrides, args, runs)
    if not args.smoke:  # free the previous variant's executables (GPU memory) before the next compiles;
      gc.collect()      # the smoke run keeps them: its variants share the small eager ops of model init
      jax.clear_caches()
  device = jax.devices()[0].device_kind
  report = {"device": device, "smoke": args.smoke, "budget_s": args.budget_s, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "variants": results, **summarize(results)}
  results_path.write_text(json.dumps(report, indent=1))
  size = "tiny smoke model" if args.smoke else "MoE-XS (64 experts, top-1)"
  plot(results, out / f"{stem}_val_loss.png", f"{size}, {args.budget_s:.0f} s each on {device}")
  print(f"\n{'variant':<14}{'tokens/s':>12}{'dropped':>9}{'steps':>8}{'val loss':>10}{'t(target)':>11}")
  for name, r in results.items():
    t = report["time_to_target_s"][name]
    print(f"{name:<14}{r['tokens_per_s']:>12,.0f}{100 * r['dropped_fraction']:>8.1f}%{r['steps']:>8}"
          f"{r['final_val_loss']:>10.3f}{'-' if t is None else f'{t:.1f} s':>11}")
  print(f"target val loss {report['target_val_loss']:.3f}; results in {out / stem}.json and {stem}_val_loss.png")
  return report


if __name__ == "__main__":
  main()
