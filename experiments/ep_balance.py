"""How evenly a training run's tokens would fall on P expert-parallel GPUs, step by step.

Expert parallelism lays the E experts out in P contiguous shards; each exchange waits for the GPU
whose shard received the most tokens (the Hopper kernels skip the empty row blocks, so a GPU's
expert time follows its tokens). From the tokens_per_expert [layers, E] that `sparsejax-train`
logs every --log-every steps, this prints, for P = 2, 4, 8, the busiest shard's tokens over the
mean (per MoE layer; the mean and the worst over layers) at each logged step, and saves the table
as JSON and a plot. bench_ep_train.py measures the same ratio (device_load) on the GPUs themselves.

  sparsejax-train --preset xs-moe --batch-size 32 --seq-len 1024 --steps 1000 --log-every 5 --out runs/bal
  python experiments/ep_balance.py runs/bal --name xs_moe_b32
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import numpy as np  # noqa: E402


def shard_load(tokens_per_expert, shards: int) -> tuple[float, float] | None:
  """(mean, max) over layers of max_p(tokens on shard p) / mean_p(tokens on shard p); None when the
  experts do not split into `shards` equal contiguous shards."""
  t = np.asarray(tokens_per_expert, np.float64)
  if t.ndim != 2 or t.shape[-1] % shards:
    return None
  per_shard = t.reshape(t.shape[0], shards, -1).sum(-1)
  ratio = per_shard.max(-1) / np.maximum(per_shard.mean(-1), 1)
  return float(ratio.mean()), float(ratio.max())


def load_train_records(run: pathlib.Path) -> list[dict]:
  path = run / "metrics.jsonl"
  if not path.exists():
    raise SystemExit(f"error: {path} not found: point at a sparsejax-train run folder")
  by_step = {}
  for line in path.read_text().splitlines():
    r = json.loads(line)
    if r.get("kind") == "train" and r.get("tokens_per_expert"):
      by_step[r["step"]] = r  # after a resume, the last record of each step
  if not by_step:
    raise SystemExit(f"error: {path} has no train records with tokens_per_expert (a dense model?)")
  return [by_step[s] for s in sorted(by_step)]


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("run", type=pathlib.Path, help="a sparsejax-train run folder (its metrics.jsonl)")
  p.add_argument("--shards", default="2,4,8")
  p.add_argument("--name", default="run", help="the result files are ep_balance_<name>.{json,md,png}")
  p.add_argument("--out", type=pathlib.Path, default=HERE / "results")
  a = p.parse_args(argv)
  shards = [int(s) for s in a.shards.split(",")]
  records = load_train_records(a.run)
  rows = []
  for r in records:
    row = {"step": r["step"], "loss": r.get("loss")}
    for n in shards:
      load = shard_load(r["tokens_per_expert"], n)
      if load is not None:
        row[f"P{n}_mean"], row[f"P{n}_max"] = load
    rows.append(row)
  # The table: the first and last logged steps and the first at or past each milestone.
  last = rows[-1]["step"]
  picked = {rows[0]["step"], last} | {next(r["step"] for r in rows if r["step"] >= s)
                                      for s in (10, 25, 50, 100, 200, 300, 500, 1000, 2000) if s <= last}
  shown = [r for r in rows if r["step"] in picked]
  cols = [n for n in shards if f"P{n}_mean" in rows[0]]
  lines = [f"### Busiest expert-parallel shard's tokens / the mean ({a.name}; mean / worst over MoE layers)", "",
           "| step | loss | " + " | ".join(f"P = {n}" for n in cols) + " |", "|---|---|" + "---|" * len(cols)]
  for r in shown:
    lines.append(f"| {r['step']} | {r['loss']:.3f} | " + " | ".join(f"{r[f'P{n}_mean']:.3f} / {r[f'P{n}_max']:.3f}" for n in cols) + " |")
  table = "\n".join(lines)
  print(table)
  a.out.mkdir(parents=True, exist_ok=True)
  report = {"name": a.name, "num_experts": len(records[0]["tokens_per_expert"][0]), "rows": rows}
  (a.out / f"ep_balance_{a.name}.json").write_text(json.dumps(report, indent=1))
  (a.out / f"ep_balance_{a.name}.md").write_text(table + "\n")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return report
  fig, ax = plt.subplots(figsize=(6, 3.5))
  steps = [r["step"] for r in rows]
  for n in cols:
    ax.plot(steps, [r[f"P{n}_mean"] for r in rows], label=f"P = {n}, mean over layers")
  ax.set_xscale("log")
  ax.set_xlabel("training step")
  ax.set_ylabel("busiest shard / mean")
  ax.axhline(1.0, color="grey", lw=0.5)
  ax.legend()
  ax.set_title(f"expert-parallel load balance over training ({a.name})", fontsize=9)
  fig.tight_layout()
  fig.savefig(a.out / f"ep_balance_{a.name}.png", dpi=120)
  return report


if __name__ == "__main__":
  main()
