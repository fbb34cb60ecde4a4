"""MegaBlocks' claim on one GPU: at equal wall time, dropless MoE reaches a given loss sooner than
capacity-factor MoE (which drops tokens) and than the dense model of the same per-token FLOPs.

Trains, each for the same training-time budget (compile and evaluation excluded), an MoE-XS-sized
model (512 hidden, 8 layers, 64 experts top-1 in every layer, bf16) as
  dropless (moe_impl auto: the library's fastest path), capacity factor 1.0 / 1.5 / 2.0, token
rounding (`rounded`: each expert's count rounded to whole 128-row blocks while training; `small dropless`
and `small rounded` compare the two on the Small-MoE preset, where an expert's products are 2.25x larger),
the dense XS model (top-1 with d_ff-sized experts = the dense FLOPs) and the dense Small model
(768 hidden, 12 layers: the larger dense model MegaBlocks compares against). Records tokens/s,
MFU, dropped fraction and validation loss over wall time and tokens to
experiments/results/megablocks*.json (and a table, megablocks*.md), and plots validation loss
against wall time and against tokens. The target loss is dense-XS's final validation loss;
time_to_target_s is when each variant first reaches it. The LR is warm-up then flat (the cosine
horizon lies far past the budget), so no variant gains from where its schedule ends.

One variant at the 300 s default budget takes about 6 minutes; run them one at a time and merge:
  python experiments/megablocks_repro.py --variants dense                 # starts megablocks.json
  python experiments/megablocks_repro.py --variants dropless --merge     # adds to it
  ...                                     (capacity 1.0 / 1.5 / 2.0, dense-small, each with --merge)
  python experiments/megablocks_repro.py --smoke         # CPU: tiny sizes, seconds each
  python experiments/megablocks_repro.py --batch-size 512 --grad-accum 4 --tag _b512x4
                                         # MegaBlocks' 512 x 1024 tokens a step, as 4 microbatches
A merge refuses results of another device, budget, batch or sequence length. With $OUT set, the
json, md and png are also copied there.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
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
    "rounded": ("xs-moe", {"token_rounding": True}),  # sparsejax.token_rounding: not dropless
    "small dropless": ("small-moe", {}),  # rounding's gain grows with an expert's products: d 768, f 3072
    "small rounded": ("small-moe", {"token_rounding": True}),
    "dense": ("xs-dense", {}),
    "dense-small": ("small-dense", {}),
}
SMOKE_MODEL = dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, num_experts=4, max_seq_len=64)
# In smoke runs the Small preset stays larger than the XS one, as it is at full size.
SMOKE_MODEL_SMALL = dict(SMOKE_MODEL, d_model=48, num_layers=3, d_ff=96)
TARGET_VARIANT = "dense"  # time_to_target_s: when each variant reaches this one's final val loss
SETTINGS = ("device", "smoke", "budget_s", "batch_size", "seq_len", "data", "adam_mu_dtype", "grad_accum")  # what merged runs must share
SETTING_DEFAULTS = {"adam_mu_dtype": "float32", "grad_accum": 1}  # for results files written before the setting existed


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
  smoke_model = SMOKE_MODEL_SMALL if preset.startswith("small") else SMOKE_MODEL
  model = {**(smoke_model if args.smoke else {}), **overrides}
  if args.moe_impl:
    model["moe_impl"] = args.moe_impl
  cfg = TrainConfig(
      preset=preset, data=args.data, out=str(out), steps=10**7, batch_size=args.batch_size,
      seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, dtype=args.dtype, adam_mu_dtype=args.adam_mu_dtype,
      grad_accum=args.grad_accum, eval_every=0,
      eval_every_s=args.budget_s / args.evals, eval_batches=args.eval_batches, ckpt_every=0,
      log_every=args.log_every, max_time_s=args.budget_s, seed=args.seed, progress=not args.no_progress,
      model_overrides=model)
  print(f"\n=== {name}: {preset} {overrides} for {args.budget_s:g} s of training", flush=True)
  final = train(cfg)
  train_rows, val_rows = load_metrics(out)
  steady = train_rows[1:] or train_rows  # the first window holds the first steps' warm-up
  mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
  tokens_per_step = args.batch_size * args.seq_len
  return {
      "preset": preset, "overrides": overrides, "steps": final["step"], "compile_s": final["compile_s"],
      "tokens_per_s": float(np.median([r["tokens_per_s"] for r in steady])),
      "mfu": float(np.median(mfus)) if mfus else None,
      "dropped_fraction": float(np.mean([np.mean(r["dropped_fraction"] or [0.0]) for r in train_rows])),
      "final_val_loss": final["val_loss"],
      # Passes over the training split: past one, validation loss measures memorizing as well.
      "epochs": final["step"] * tokens_per_step / final["train_tokens"],
      "val_curve": [{"elapsed_s": r["elapsed_s"], "step": r["step"], "tokens": r["step"] * tokens_per_step,
                     "val_loss": r["val_loss"]} for r in val_rows],
  }


def summarize(results: dict) -> dict:
  """The target (dense-XS's final validation loss), and when each variant first reached it
  (None: not within its budget, or no dense-XS run to set the target)."""
  target = results[TARGET_VARIANT]["final_val_loss"] if TARGET_VARIANT in results else None
  times = {n: None if target is None else time_to_reach(r["val_curve"], target) for n, r in results.items()}
  tokens = {n: None if target is None else time_to_reach(
      [{"elapsed_s": p["tokens"], "val_loss": p["val_loss"]} for p in r["val_curve"] if "tokens" in p], target)
      for n, r in results.items()}
  return {"target": f"final validation loss of {TARGET_VARIANT!r} (dense-XS)", "target_val_loss": target,
          "time_to_target_s": times, "tokens_to_target": tokens}


def load_for_merge(path: pathlib.Path, settings: dict) -> dict:
  """The variants of an earlier results file, after checking it was measured the same way."""
  if not path.exists():
    return {}
  old = json.loads(path.read_text())
  was = lambda k: old.get(k, SETTING_DEFAULTS.get(k))
  differ = [f"{k}: {was(k)!r} there, {settings[k]!r} here" for k in SETTINGS if was(k) != settings[k]]
  if differ:
    raise SystemExit(f"--merge: {path} was measured otherwise ({'; '.join(differ)}); "
                     f"use the same settings or another --out.")
  return old["variants"]


def plot(results: dict, path: pathlib.Path, title: str, target: float | None = None) -> None:
  """Validation loss against training wall time (left) and against training tokens (right)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
  for name, r in results.items():
    c = r["val_curve"]
    label = f"{name} ({r['tokens_per_s']:,.0f} tok/s, {100 * r['dropped_fraction']:.1f}% dropped)"
    loss = [p["val_loss"] for p in c]
    axes[0].plot([p["elapsed_s"] for p in c], loss, "o-", ms=3, label=label)
    axes[1].plot([p.get("tokens", np.nan) for p in c], loss, "o-", ms=3, label=label)
  axes[0].set(xlabel="training wall time (s)", ylabel="validation loss (nats/byte)")
  axes[1].set(xlabel="training tokens")
  for ax in axes:
    if target is not None:
      ax.axhline(target, color="gray", ls="--", lw=1, label="target: dense-XS final loss")
    ax.grid(alpha=0.3)
  axes[1].legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def table(report: dict) -> str:
  """Markdown: throughput, MFU, drops, final loss and the time (and tokens) to the target loss."""
  target = report["target_val_loss"]
  lines = [f"# MegaBlocks experiment on {report['device']}: {report['budget_s']:g} s of training per variant",
           "", f"corpus {report['data']}; batch {report['batch_size']} x {report['seq_len']} tokens; "
           + ("" if report.get("grad_accum", 1) == 1
              else f"{report['grad_accum']} microbatches of {report['batch_size'] // report['grad_accum']} a step; ")
           + ("" if report.get("adam_mu_dtype", "float32") == "float32"
              else f"AdamW first moment in {report['adam_mu_dtype']}; ") +
           f"target: {report['target']}"
           + ("" if target is None else f" = {target:.4f}") + ".", "",
           "| variant | preset | tokens/s | MFU | dropped | steps | epochs | final val loss | time to target "
           "| tokens to target |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for name, r in report["variants"].items():
    t, n = report["time_to_target_s"][name], report["tokens_to_target"][name]
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    lines.append(f"| {name} | {r['preset']} | {r['tokens_per_s']:,.0f} | {mfu} | {100 * r['dropped_fraction']:.1f}% "
                 f"| {r['steps']} | {r['epochs']:.2f} | {r['final_val_loss']:.4f} | {'not reached' if t is None else f'{t:.1f} s'} "
                 f"| {'-' if n is None else f'{n / 1e6:.1f} M'} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--budget-s", type=float, default=None, help="training seconds per variant (GPU default 300)")
  p.add_argument("--smoke", action="store_true", help="tiny model and budget: checks the script on a CPU")
  p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  p.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
  p.add_argument("--data", default=None, help="corpus (default: the Python standard library)")
  p.add_argument("--batch-size", type=int, default=None)
  p.add_argument("--seq-len", type=int, default=None)
  p.add_argument("--lr", type=float, default=6e-4)
  p.add_argument("--warmup", type=int, default=100)
  p.add_argument("--dtype", default=None, help="compute dtype (default bfloat16 on GPU)")
  p.add_argument("--adam-mu-dtype", default="float32", choices=["float32", "bfloat16"],
                 help="AdamW's first moment, for every variant (bfloat16: 4 fewer bytes a parameter a step)")
  p.add_argument("--grad-accum", type=int, default=1,
                 help="microbatches per step: --batch-size sequences per AdamW update in the memory of fewer "
                      "(MegaBlocks trained with 512 x 1024 tokens a step)")
  p.add_argument("--tag", default="", help="appended to the results files' names (megablocks<tag>.json, ...)")
  p.add_argument("--moe-impl", default=None, help="grouped-matmul backend for MoE layers (default auto)")
  p.add_argument("--evals", type=int, default=30, help="validation points per run")
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
    defaults = dict(budget_s=300.0, batch_size=32, seq_len=1024, log_every=args.log_every)
  for k, v in defaults.items():
    if getattr(args, k) is None or (args.smoke and k in ("warmup", "log_every")):
      setattr(args, k, v)

  out = pathlib.Path(args.out)
  runs = out / ("runs_smoke" if args.smoke else "runs")
  stem = ("megablocks_smoke" if args.smoke else "megablocks") + args.tag
  results_path = out / f"{stem}.json"
  device = jax.devices()[0].device_kind
  settings = {"device": device, "smoke": args.smoke, "budget_s": args.budget_s, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "data": args.data or "stdlib", "adam_mu_dtype": args.adam_mu_dtype,
              "grad_accum": args.grad_accum}
  results = load_for_merge(results_path, settings) if args.merge else {}
  for name in args.variants:
    preset, overrides = VARIANTS[name]
    results[name] = run_variant(name, preset, overrides, args, runs)
    if not args.smoke:  # free the previous variant's executables (GPU memory) before the next compiles;
      gc.collect()      # the smoke run keeps them: its variants share the small eager ops of model init
      jax.clear_caches()
  results = {n: results[n] for n in sorted(results, key=lambda n: list(VARIANTS).index(n) if n in VARIANTS else 99)}
  report = {**settings, "variants": results, **summarize(results)}
  out.mkdir(parents=True, exist_ok=True)
  results_path.write_text(json.dumps(report, indent=1))
  (out / f"{stem}.md").write_text(table(report))
  size = "tiny smoke models" if args.smoke else "MoE-XS (64 experts, top-1) and dense XS / Small"
  plot(results, out / f"{stem}_val_loss.png", f"{size}, {args.budget_s:g} s each on {device}",
       report["target_val_loss"])
  print("\n" + table(report))
  print(f"results in {results_path}, {stem}.md and {stem}_val_loss.png")
  dest = pathlib.Path(os.environ.get("OUT", out))  # the device machine hands back what lies under $OUT
  if dest.resolve() != out.resolve():
    for name in (f"{stem}.json", f"{stem}.md", f"{stem}_val_loss.png"):
      shutil.copy(out / name, dest / name)
  return report


if __name__ == "__main__":
  main()
