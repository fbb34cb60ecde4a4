"""Where tgmm's time goes at short reductions: per K step, per tile, per tail.

At E64 top-1 (d = 1024, f = 4096, 64 experts, ~256 rows an expert) our tgmm (x^T dH, the [E, d, f]
weight gradient) runs ~0.37 ms against cuBLAS's 0.28 on the balanced layout, while at E8 top-2
(4,224 rows an expert) it beats cuBLAS (738 against 714 TFLOP/s, results/tgmm_sweep_H100.log).
So the loss is per tile, not per K step. This times, on exactly balanced routings (every expert
`rows` real rows: no routing noise), our tgmm and cuBLAS's batched product for
  rows = 128, 256, 512, 1024   -> t(rows) = tiles/SM * (steps * t_step + t_tile): the fit's two terms
  rows = 256, 272, 320         -> 4 steps; 5 steps whose last holds 16 real rows (masked); 5 full steps
and three ablations (unchecked, their outputs are garbage): the stores removed (mosaic._store_tile a
no-op), the TMA stores alone removed (the epilogue's conversion, shared-memory writes and fences
kept: what the consumers' epilogue costs without the global writes), and the tail mask's
read-modify-write removed (the last step's rows are zero here anyway). "pingpong <rows>" times the
ping-pong schedule (mosaic_pingpong.py: 128 x 128 tiles, each consumer owning every second tile, one's
epilogue under the other's wgmmas) beside ours, checked like ours. --random adds tune_gmm's
E64 top-1 (random routing), both schedules. 2-CTA clusters were measured with this script and reverted
(experiments/notes_hopper_kernels.md).
Variants are timed in interleaved rounds (medians); every checked output is compared with the
float32 reference. "us per tile" counts 128 x 256 tiles (the default schedule's), whatever the
variant's own tile. GPU only.

  python experiments/probe_tgmm_tiles.py                 # the table, JSON under $OUT or results/
  python experiments/probe_tgmm_tiles.py --ncu 256       # one launch of ours at 256 rows, for ncu
"""
import argparse
import json
import math
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.join(os.path.dirname(__file__), "..")]
import tune_gmm  # noqa: E402
from sparsejax.kernels.gmm import mosaic  # noqa: E402
from sparsejax.kernels.gmm.reference import real_rows, tgmm_reference  # noqa: E402
from sparsejax.topology import make_topology  # noqa: E402

E, D, F, BLOCK = 64, 1024, 4096, 128


def problem(rows):
  """x [E * padded, d], dH [E * padded, f]: every expert `rows` real rows, padding rows zero."""
  padded = -(-rows // BLOCK) * BLOCK
  topo = make_topology(jnp.full((E,), padded, jnp.int32), E * padded, BLOCK, jnp.full((E,), rows, jnp.int32))
  real = real_rows(topo)[:, None]
  k1, k2 = jax.random.split(jax.random.key(rows))
  x = jnp.where(real, jax.random.normal(k1, (E * padded, D), jnp.bfloat16), 0)
  dh = jnp.where(real, jax.random.normal(k2, (E * padded, F), jnp.bfloat16), 0)
  return topo, x, dh


def ours(topo, configs=None):
  """tgmm on `configs`, by default the per-tile schedule at every length (the default configs
  take the ping-pong one below SHORT_ROWS rows an expert)."""
  configs = configs or mosaic.DEFAULT_CONFIGS.with_tgmm(pingpong=False)
  return jax.jit(lambda a, b: mosaic.tgmm(a, b, topo, a.dtype, configs))


def pingpong_configs():
  """The default configs with every tgmm config on the ping-pong schedule."""
  return mosaic.DEFAULT_CONFIGS.with_tgmm(pingpong=True)


def cublas(x, dh, rows):
  """The same product on contiguous [E, rows, .] operands (sliced once, outside the timing):
  XLA's batched matmul (cuBLAS). -> (fn, a, b)"""
  a, b = x.reshape(E, -1, D)[:, :rows], dh.reshape(E, -1, F)[:, :rows]
  return jax.jit(lambda a, b: jnp.einsum("ecd,ecf->edf", a, b)), a, b


class Ablation:
  """Trace a kernel with one piece of mosaic.py replaced (restored on exit)."""

  def __init__(self, what):
    self.what = what

  def __enter__(self):
    self.saved = mosaic._store_tile, mosaic._zero_rows_from, mosaic.plgpu.copy_smem_to_gmem
    if self.what == "no_store":
      mosaic._store_tile = lambda *a, **k: None
    elif self.what == "no_mask":
      mosaic._zero_rows_from = lambda *a, **k: None
    elif self.what == "no_tma_store":  # the epilogue up to the TMA store: smem writes and fences
      mosaic.plgpu.copy_smem_to_gmem = lambda *a, **k: None
    return self

  def __exit__(self, *exc):
    mosaic._store_tile, mosaic._zero_rows_from, mosaic.plgpu.copy_smem_to_gmem = self.saved


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", default="128,256,272,320,512,1024")
  ap.add_argument("--ablate-at", default="256,272,1024")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--ncu", type=int, default=0, help="only launch ours once at this many rows")
  ap.add_argument("--no-cublas", action="store_true")
  ap.add_argument("--random", action="store_true",
                  help="also tune_gmm's E64_top1 (random routing): both weight gradients")
  args = ap.parse_args()
  if args.ncu:
    import torch

    topo, x, dh = problem(args.ncu)
    f = ours(topo)
    jax.block_until_ready(f(x, dh))
    torch.cuda.cudart().cudaProfilerStart()
    jax.block_until_ready(f(x, dh))
    torch.cuda.cudart().cudaProfilerStop()
    return

  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {mosaic._num_sms()} SMs", flush=True)
  variants = {}  # name -> (fn, x, dh, rows, check)
  for rows in map(int, args.rows.split(",")):
    topo, x, dh = problem(rows)
    want = tgmm_reference(x, dh, topo)
    f = ours(topo)
    err = tune_gmm.rel_err(f(x, dh), want)
    fp = ours(topo, pingpong_configs())
    errp = tune_gmm.rel_err(fp(x, dh), want)
    fc, xc, dhc = cublas(x, dh, rows)
    errc = tune_gmm.rel_err(fc(xc, dhc), want)
    print(f"rows {rows}: ours rel err {err:.1e}, pingpong {errp:.1e}, cuBLAS {errc:.1e}", flush=True)
    assert err < 2e-2 and errp < 2e-2 and errc < 2e-2, rows
    variants[f"ours {rows}"] = (f, x, dh, rows)
    variants[f"pingpong {rows}"] = (fp, x, dh, rows)
    if not args.no_cublas:
      variants[f"cublas {rows}"] = (fc, xc, dhc, rows)
    if str(rows) in args.ablate_at.split(","):
      for what in ("no_store", "no_tma_store", "no_mask"):
        if what == "no_mask" and rows % 64 == 0:
          continue  # no masked step at whole 64-row steps: nothing to ablate
        with Ablation(what):
          g = ours(topo)
          jax.block_until_ready(g(x, dh))  # traced and compiled with the piece replaced
        variants[f"ours {rows} {what}"] = (g, x, dh, rows)
  if args.random:
    p = tune_gmm.problem("E64_top1")
    for op in ("x^T@dh", "h^T@dy"):
      _, lhs, other, _, _ = tune_gmm.products(p)[op]
      want = tgmm_reference(lhs, other, p["topo"])
      f = ours(p["topo"])
      err = tune_gmm.rel_err(f(lhs, other), want)
      fp = ours(p["topo"], pingpong_configs())
      errp = tune_gmm.rel_err(fp(lhs, other), want)
      print(f"E64_top1 {op}: rel err {err:.1e}, pingpong {errp:.1e}", flush=True)
      assert err < 2e-2 and errp < 2e-2, op
      variants[f"E64_top1 {op}"] = (f, lhs, other, p["N"] // E)
      variants[f"E64_top1 {op} pingpong"] = (fp, lhs, other, p["N"] // E)
  times = {n: [] for n in variants}
  for _ in range(args.rounds):
    for n, (f, x, dh, _) in variants.items():
      times[n].append(tune_gmm.timeit(f, x, dh) * 1e3)
  tiles_per_sm = E * (D // BLOCK) * (F // 256) / mosaic._num_sms()
  records = []
  print(f"\n{'variant':24s} {'ms (median of rounds)':>22s} {'TFLOP/s':>8s} {'us per tile':>12s}  rounds")
  for n, ts in times.items():
    rows = variants[n][3]
    ms = statistics.median(ts)
    tf = 2 * E * rows * D * F / (ms * 1e-3) / 1e12
    per_tile = ms * 1e3 / tiles_per_sm
    records.append(dict(variant=n, rows=rows, ms=ms, tflops=tf, us_per_tile=per_tile, rounds=ts))
    print(f"{n:24s} {ms:22.3f} {tf:8.1f} {per_tile:12.2f}  {np.round(ts, 3).tolist()}")
  # t = tiles/SM * (steps * t_step + t_tile), least squares over the whole-step balanced rows
  pts = [(r["rows"] // 64, r["us_per_tile"]) for r in records
         if r["variant"] == f"ours {r['rows']}" and r["rows"] % 64 == 0]
  if len(pts) >= 2:
    s, t = np.array(pts, float).T
    slope, icpt = np.polyfit(s, t, 1)
    print(f"\nfit over {len(pts)} row counts: t_step {slope:.3f} us, t_tile {icpt:.3f} us "
          f"(a tile of 4 steps: {4 * slope:.2f} us of steps, {icpt:.2f} us of tile overhead)")
  out = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
  with open(os.path.join(out, "tgmm_tiles_probe.json"), "w") as fh:
    json.dump(dict(gpu=jax.devices()[0].device_kind, jax=jax.__version__, records=records), fh, indent=1)


if __name__ == "__main__":
  main()
