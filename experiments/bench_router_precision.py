"""The router's float32 product, forward and backward, at each precision a GPU offers.

  python experiments/bench_router_precision.py [--shapes E64_top1,E8_top2,XS_b128] [--out-dir DIR] [--smoke]

logits = x W_r in float32 (x [T, d], W_r [d, E]), then dx = g W_r^T and dW_r = x^T g for a random
cotangent g: the three products a training step runs for the router. Each variant is timed with the
MoE benchmark's timer (peers.common.Timer) and checked against float64 on the host:

- `default`: precision None. A GPU reads float32 operands as TF32 (10-bit mantissas).
- `highest`: Precision.HIGHEST, full float32 on the float32 cores (what router_logits asked for before).
- `tf32_x3`, `bf16_x6`, `bf16_x3`: jax.lax.DotAlgorithmPreset, float32 products split into several
  tensor-core passes (3 TF32, 6 or 3 bf16). A backend without the algorithm is reported, not timed.
- `sparsejax`: `routing.router_logits` (six bf16 passes for the logits and dW_r; x's gradient, rounded
  to bf16, at the default).

Prints a table; writes router_precision_<device>.json and .png under --out-dir (router_precision_<device>_smoke.*
with --smoke, as the other benchmarks' smoke runs, so a smoke run never overwrites measured results).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers.common import Timer  # noqa: E402

from sparsejax.routing import router_logits  # noqa: E402

PRESET = jax.lax.DotAlgorithmPreset
VARIANTS = {
    "default": None,
    "highest": jax.lax.Precision.HIGHEST,
    "tf32_x3": PRESET.TF32_TF32_F32_X3,
    "bf16_x6": PRESET.BF16_BF16_F32_X6,
    "bf16_x3": PRESET.BF16_BF16_F32_X3,
    # What the library runs: the logits and dW_r in six bf16 passes, a bf16 x's gradient at the default.
    "sparsejax": None,
}
# (tokens, d_model, experts): the MoE benchmark's E64 and E8 shapes, and MoE-XS at 128 x 1024 tokens.
SHAPES = {"E64_top1": (16384, 1024, 64), "E8_top2": (16384, 2048, 8), "XS_b128": (131072, 512, 64)}
SMOKE_SHAPES = {"tiny": (256, 64, 8)}  # --smoke: the CPU test of this script


def router_fwd_bwd(variant: str):
  """(logits, dx, dW) of x W at the variant's precision (x arrives in bf16 and is cast, as in
  router_logits), or of sparsejax.router_logits itself."""
  def logits(x, w):
    return jnp.matmul(x.astype(jnp.float32), w, precision=VARIANTS[variant])

  def f(x, w, g):
    y, vjp = jax.vjp(router_logits if variant == "sparsejax" else logits, x, w)
    dx, dw = vjp(g)
    return y, dx, dw
  return jax.jit(f)


def rel_err(got, want) -> float:
  got = np.asarray(got, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def bench_shape(name: str, T: int, d: int, E: int, timer: Timer) -> list[dict]:
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (T, d), jnp.bfloat16)
  w = jax.random.normal(kw, (d, E), jnp.float32) / np.sqrt(d)
  g = jax.random.normal(kg, (T, E), jnp.float32)
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x.astype(jnp.float32), w, g))
  want = (x64 @ w64, g64 @ w64.T, x64.T @ g64)
  records = []
  for variant in VARIANTS:
    rec = {"shape": name, "T": T, "d": d, "E": E, "variant": variant}
    fn = router_fwd_bwd(variant)
    try:
      out = jax.block_until_ready(fn(x, w, g))
    except Exception as e:  # an algorithm the backend lacks: reported, not timed
      rec["unsupported"] = str(e).splitlines()[0][:200]
      records.append(rec)
      print(f"{name:9s} {variant:8s} unsupported: {rec['unsupported']}", flush=True)
      continue
    rec.update({f"err_{k}": rel_err(o, r) for k, o, r in zip(("logits", "dx", "dw"), out, want)})
    t = timer(lambda: fn(x, w, g), jax.block_until_ready)
    rec["ms"] = t["median_s"] * 1e3
    rec["ms_min"], rec["ms_max"] = t["min_s"] * 1e3, t["max_s"] * 1e3
    records.append(rec)
    print(f"{name:9s} {variant:8s} {rec['ms']:8.4f} ms  err logits {rec['err_logits']:.1e} "
          f"dx {rec['err_dx']:.1e} dW {rec['err_dw']:.1e}", flush=True)
  return records


def markdown(records: list[dict]) -> str:
  lines = ["| shape (T, d, E) | variant | fwd+bwd ms | rel err logits | dx | dW_r |", "|---|---|---|---|---|---|"]
  for r in records:
    head = f"| {r['shape']} ({r['T']}, {r['d']}, {r['E']}) | {r['variant']} |"
    if "unsupported" in r:
      lines.append(f"{head} unsupported | | | |")
    else:
      lines.append(f"{head} {r['ms']:.4f} | {r['err_logits']:.1e} | {r['err_dx']:.1e} | {r['err_dw']:.1e} |")
  return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
  try:
    import matplotlib
  except ImportError:
    print("no matplotlib: plot skipped", flush=True)
    return
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for r in records:
    if "ms" in r:
      ax.scatter(r["ms"], max(r["err_dw"], r["err_logits"], r["err_dx"]), label=f"{r['shape']} {r['variant']}")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("router fwd+bwd, ms (median)")
  ax.set_ylabel("largest relative error vs float64")
  ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
  ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
  ap.add_argument("--smoke", action="store_true", help="a tiny shape, one repeat: runs on a CPU in seconds")
  args = ap.parse_args(argv)
  known = SMOKE_SHAPES if args.smoke else SHAPES
  shapes = list(SMOKE_SHAPES) if args.smoke else [s for s in args.shapes.split(",") if s]
  unknown = [s for s in shapes if s not in known]
  if unknown or not shapes:
    ap.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
  timer = Timer(min_repeat_s=0.0, repeats=1, warmup=0) if args.smoke else Timer()
  device = jax.devices()[0].device_kind.replace(" ", "_")
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  records = [r for s in shapes for r in bench_shape(s, *known[s], timer)]
  print(markdown(records), flush=True)
  os.makedirs(args.out_dir, exist_ok=True)
  stem = os.path.join(args.out_dir, f"router_precision_{device}" + ("_smoke" if args.smoke else ""))
  with open(stem + ".json", "w") as fh:
    json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "smoke": args.smoke,
               "records": records}, fh, indent=1)
  plot(records, stem + ".png")
  return records


if __name__ == "__main__":
  main()
