"""Plots from training metrics (metrics.jsonl): loss vs steps, loss vs wall time, expert load.

  pip install -e ".[plot]"     # matplotlib, which the base install leaves out
  python experiments/plot.py runs/tiny [runs/other ...] --out plots/
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

MISSING_MATPLOTLIB = 'plotting needs matplotlib, which the base install leaves out: pip install -e ".[plot]"'


def pyplot():
  """matplotlib.pyplot on the file-only Agg backend (works without a display); imported on use."""
  try:
    import matplotlib
  except ImportError:
    raise ImportError(MISSING_MATPLOTLIB) from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def load_metrics(path: str | pathlib.Path) -> tuple[list[dict], list[dict]]:
  """(train rows, val rows) sorted by step; a resumed run's repeated steps keep their last record."""
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / "metrics.jsonl"
  if not path.is_file():
    raise FileNotFoundError(f"no metrics file at {str(path)!r}: pass a run folder of sparsejax-train "
                            f"(its --out) or its metrics.jsonl.")
  rows = {"train": {}, "val": {}}
  for line in path.read_text().splitlines():
    if line.strip():
      r = json.loads(line)
      rows[r["kind"]][r["step"]] = r
  return [rows["train"][s] for s in sorted(rows["train"])], [rows["val"][s] for s in sorted(rows["val"])]


def _loss_plot(runs: dict, x_key: str, xlabel: str, path: pathlib.Path) -> pathlib.Path:
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for i, (name, (train, val)) in enumerate(runs.items()):
    color = f"C{i}"
    if train:
      ax.plot([r[x_key] for r in train], [r["loss"] for r in train], color=color, alpha=0.4, label=f"{name} train")
    if val:
      ax.plot([r[x_key] for r in val], [r["val_loss"] for r in val], "o-", color=color, label=f"{name} val")
  ax.set(xlabel=xlabel, ylabel="loss (nats/token)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def expert_load_plot(train: list[dict], path: pathlib.Path, title: str = "") -> pathlib.Path | None:
  """Heat map of the fraction of tokens per expert (rows: MoE layers) over the last logged step,
  and the max/mean load ratio over training (1 = perfectly balanced)."""
  rows = [r for r in train if np.size(r.get("tokens_per_expert", [])) > 0]
  if not rows:
    return None
  last = np.asarray(rows[-1]["tokens_per_expert"], float)
  frac = last / last.sum(-1, keepdims=True)
  plt = pyplot()
  imbalance = [np.mean(np.max(t, -1) / np.mean(t, -1)) for t in (np.asarray(r["tokens_per_expert"], float) for r in rows)]
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
  im = a.imshow(frac, aspect="auto", cmap="viridis")
  a.set(xlabel="expert", ylabel="MoE layer", title=f"token fraction, step {rows[-1]['step']} {title}")
  a.set_yticks(range(frac.shape[0]))
  fig.colorbar(im, ax=a)
  b.plot([r["step"] for r in rows], imbalance)
  b.set(xlabel="step", ylabel="max / mean tokens per expert", title="load imbalance")
  b.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot_runs(run_dirs: list[str], out: str | pathlib.Path) -> list[pathlib.Path]:
  """Write loss_vs_steps.png, loss_vs_time.png and one expert_load_<run>.png per MoE run."""
  runs = {pathlib.Path(d).name or str(d): load_metrics(d) for d in run_dirs}
  pyplot()  # fails before the output folder is made
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  paths = [_loss_plot(runs, "step", "step", out / "loss_vs_steps.png"),
           _loss_plot(runs, "elapsed_s", "training wall time (s)", out / "loss_vs_time.png")]
  for name, (train, _) in runs.items():
    p = expert_load_plot(train, out / f"expert_load_{name}.png", name)
    if p:
      paths.append(p)
  return paths


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
  p.add_argument("--out", default="plots")
  args = p.parse_args(argv)
  try:
    paths = plot_runs(args.runs, args.out)
  except (ImportError, FileNotFoundError, ValueError) as e:  # one line, no traceback
    print(f"plot.py: error: {e}", file=sys.stderr)
    raise SystemExit(2)
  for path in paths:
    print(path)


if __name__ == "__main__":
  main()
