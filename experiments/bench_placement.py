"""Dropless placement: the stable argsort (permute.dropless_placement) against the sort-free
histogram + cumulative sum (permute.dropless_placement_histogram), jitted, on the default device.

Each variant's Placement is first checked equal to the argsort one on the same routing. A timed
call runs `--repeats` placements of different routings in one jitted program (so the time is
device work plus in-program launches, not Python dispatch) and reports the median over reps
divided by the repeats. Block size 128 (the Pallas layout). Writes
experiments/results/placement_<device>.{json,md} (and a copy under $OUT when set).

  python experiments/bench_placement.py            # GPU: T x k x E of the issue and MoE-XS
  python experiments/bench_placement.py --shapes 65536,8,32 32768,8,64 --chunks 16 32 64
  python experiments/bench_placement.py --smoke    # CPU: small shapes, seconds

A plot of microseconds per placement against the assignments T k, a line per variant and routing, goes beside
the table (placement_<device>.png) where matplotlib is installed (`pip install -e ".[plot]"`).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from sparsejax import permute  # noqa: E402
from sparsejax.topology import BLOCK_SIZE  # noqa: E402
from out_dir import copy_to_out  # noqa: E402
from plot import pyplot  # noqa: E402

SHAPES = [(16384, 1, 64), (8192, 8, 64), (32768, 1, 64), (16384, 2, 8)]  # (T, k, E); 32768 x 1 x 64 is MoE-XS
SMOKE_SHAPES = [(512, 1, 16), (256, 4, 8)]
CHUNKS = (16, 32, 64)  # 128 and up: 4-10x slower, or no compile, from 2^18 assignments (H200)


def variants(chunks) -> dict:
  out = {"argsort": lambda ids, E: permute.dropless_placement(ids, E, block_size=BLOCK_SIZE),
         "histogram default": lambda ids, E: permute.dropless_placement_histogram(ids, E, block_size=BLOCK_SIZE)}
  for c in chunks:
    out[f"histogram chunk={c}"] = (
        lambda ids, E, c=c: permute.dropless_placement_histogram(ids, E, block_size=BLOCK_SIZE, chunk=c))
  return out


def routings(key, repeats: int, T: int, k: int, E: int, skewed: bool) -> jax.Array:
  """[repeats, T, k] distinct expert ids per token: uniform, or (skewed) Zipf-like expert popularity."""
  logits = jax.random.gumbel(key, (repeats, T, E))
  if skewed:
    logits = logits - 1.5 * jnp.log1p(jnp.arange(E, dtype=jnp.float32))
  return jax.lax.top_k(logits, k)[1].astype(jnp.int32)


def timed(fn, E: int, ids_stack: jax.Array, reps: int):
  """Median seconds per placement: one jitted call places every routing of the stack."""
  def many(stack):
    return [fn(stack[i], E).rows for i in range(stack.shape[0])]
  f = jax.jit(many)
  jax.block_until_ready(f(ids_stack))
  jax.block_until_ready(f(ids_stack))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(ids_stack))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) / ids_stack.shape[0]


def check_equal(fn, ref, E: int, ids: jax.Array, name: str) -> None:
  a, b = jax.jit(ref, static_argnums=1)(ids, E), jax.jit(fn, static_argnums=1)(ids, E)
  for field in ("rows", "group_sizes", "tokens_per_expert", "num_dropped"):
    if not np.array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field))):
      raise AssertionError(f"{name}: {field} differs from the argsort placement")


def shape(text: str) -> tuple[int, int, int]:
  """'T,k,E' -> (T, k, E), each positive and k <= E."""
  try:
    T, k, E = (int(v) for v in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: a shape is T,k,E (three integers)") from None
  if min(T, k, E) < 1 or k > E:
    raise argparse.ArgumentTypeError(f"{text!r}: needs T, k, E >= 1 and k <= E")
  return T, k, E


def save_plot(rows: list[dict], title: str, path: pathlib.Path) -> pathlib.Path | None:
  """us per placement against T k (log-log), a line per variant and routing; None without matplotlib."""
  try:
    plt = pyplot()
  except ImportError as e:
    print(f"no plot: {e}")
    return None
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for i, name in enumerate(dict.fromkeys(r["variant"] for r in rows)):
    for skewed, style in ((False, "o-"), (True, "x--")):
      pts = sorted((r["T"] * r["k"], r["us"]) for r in rows if r["variant"] == name and r["skewed"] == skewed)
      if pts:
        ax.plot(*zip(*pts), style, color=f"C{i}", label=f"{name}{' skewed' if skewed else ''}")
  ax.set(xscale="log", yscale="log", xlabel="assignments T k", ylabel="us per placement", title=title)
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true", help="small shapes (CPU)")
  p.add_argument("--repeats", type=int, default=8, help="placements per timed program")
  p.add_argument("--reps", type=int, default=20, help="timed calls; the median is reported")
  p.add_argument("--chunks", type=int, nargs="+", default=list(CHUNKS))
  p.add_argument("--shapes", type=shape, nargs="+", default=None, metavar="T,k,E",
                 help="the shapes to place (default: the issue's and MoE-XS's)")
  p.add_argument("--tag", default="", help="suffix of the result files' names")
  p.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
  args = p.parse_args(argv)
  if min(args.chunks) < 1:
    p.error("--chunks must be positive")
  shapes = args.shapes or (SMOKE_SHAPES if args.smoke else SHAPES)
  if args.smoke:
    args.repeats, args.reps = min(args.repeats, 2), min(args.reps, 3)
  device = jax.devices()[0].device_kind
  fns = variants(args.chunks)
  rows = []
  for T, k, E in shapes:
    for skewed in (False, True):
      stack = routings(jax.random.key(T * 1000 + k * 100 + E), args.repeats, T, k, E, skewed)
      label = f"T={T} k={k} E={E}" + (" skewed" if skewed else "")
      base = None
      for name, fn in fns.items():
        check_equal(fn, fns["argsort"], E, stack[0], f"{label} {name}")
        us = 1e6 * timed(fn, E, stack, args.reps)
        base = base or us
        rows.append(dict(T=T, k=k, E=E, skewed=skewed, variant=name, us=us, speedup=base / us))
        print(f"{label:<28}{name:<22}{us:>10.1f} us{base / us:>8.2f}x", flush=True)
  report = {"device": device, "block_size": BLOCK_SIZE, "repeats": args.repeats, "reps": args.reps,
            "smoke": args.smoke, "rows": rows}
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  stem = "placement_" + re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_") + ("_smoke" if args.smoke else "") + args.tag
  (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
  lines = [f"# Dropless placement on {device} (block {BLOCK_SIZE}, median of {args.reps}, "
           f"{args.repeats} placements per program)", "",
           "| T | k | E | routing | variant | us per placement | vs argsort |", "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['T']} | {r['k']} | {r['E']} | {'skewed' if r['skewed'] else 'uniform'} | {r['variant']} "
            f"| {r['us']:.1f} | {r['speedup']:.2f}x |" for r in rows]
  (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
  png = save_plot(rows, f"Dropless placement on {device}", out / f"{stem}.png")
  copy_to_out(*(out / f"{stem}{suffix}" for suffix in (".json", ".md")), *([png] if png else []))
  print(f"wrote {out / stem}.{{json,md{',png' if png else ''}}}")
  return report


if __name__ == "__main__":
  main()
