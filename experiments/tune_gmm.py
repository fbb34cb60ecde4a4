"""The grouped products alone on one GPU: check each backend against the reference, time it
against the balanced batched matmul (XLA) and JAX's ragged_dot_mgpu, and sweep Mosaic configs.

  python experiments/tune_gmm.py                      # default configs, the issue's shapes
  python experiments/tune_gmm.py --sweep              # also try the config grid, print the best
  python experiments/tune_gmm.py --shapes E64_top1 --ops fwd
  python experiments/tune_gmm.py --shapes E64_top1 --no-store --dense-clusters   # what bounds gmm

--no-store adds an ablation of each gmm: the same kernel with its epilogue's stores removed (its
output is garbage and not checked), so the gap to the default is what the epilogue costs the K loop.
--dense-clusters times jax's own dense Hopper matmul (hopper_matmul_mgpu) with and without 2-CTA
clusters (TMA multicast of the tile the pair shares) beside cuBLAS on products of E64 top-1's sizes:
whether multicast pays in Mosaic on this GPU, before the grouped kernels take it on.

Useful TFLOP/s count 2*N*K*N_out per product with N the real (unpadded) rows. Timing: the median
over repeats of the wall time of `iters` back-to-back asynchronous calls after warm-up (the GPU
queue stays full, so launch overhead is hidden once a call takes more than a few microseconds).
Writes experiments/results/gmm_kernels_<gpu>.json (and a copy under $OUT when set).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsejax import permute  # noqa: E402
from sparsejax.kernels import gmm as G  # noqa: E402
from sparsejax.kernels.gmm import mosaic, triton  # noqa: E402
from sparsejax.topology import make_topology  # noqa: E402
from sparsejax.kernels.gmm.reference import real_rows  # noqa: E402
from out_dir import copy_to_out  # noqa: E402

SHAPES = {  # T, d, f, E, k
    "E64_top1": (16384, 1024, 4096, 64, 1),
    "E8_top2": (16384, 2048, 8192, 8, 2),
    "E64_top8": (8192, 2048, 1024, 64, 8),
    # An MoE-XS layer at the MegaBlocks run's 128 x 1024 tokens a step (experiments/megablocks_repro.py)
    "XS_b128": (131072, 512, 2048, 64, 1),
    # E64 top-1 with bench_moe_layer's skewed routing (expert i chosen with probability ~ (i+1)^-0.5:
    # 137 to 1,064 rows an expert, mean 256)
    "E64_top1_skewed": (16384, 1024, 4096, 64, 1),
}


def log(*a):
  print(*a, flush=True)


def interpret_compat() -> None:
  """Readies jax's GPU interpreter for a --smoke run's Mosaic kernels off a GPU (nothing on a GPU).

  jax < 0.11's interpreter stops on a transposed wgmma operand (tgmm's X^T, gmm_dact's W_out^T):
  the kernel thread whose callback raises ends, and the kernel's other threads wait at their
  barrier for ever, so bench_gmm_skew.py and ncu_gmm_kernels.py --smoke hung on jax 0.10.2. The
  tests' shim (tests/mosaic_interpret_compat.py) reads such an operand through its indexers and
  then transposes it (a no-op on jax >= 0.11), and compiles each kernel thread's body once (an
  interpreted call ~0.5 s on two cores instead of ~1.5 s). What the kernels compute is unchanged."""
  if jax.default_backend() == "gpu":
    return
  tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
  if tests not in sys.path:
    sys.path.append(tests)
  import mosaic_interpret_compat
  mosaic_interpret_compat.install()
  mosaic_interpret_compat.compile_thread_bodies_once()


def timeit(fn, *args, warmup=3, iters=10, reps=7):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


def rel_err(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def problem(name, dtype=jnp.bfloat16):
  T, d, f, E, k = SHAPES[name]
  keys = jax.random.split(jax.random.key(0), 6)
  g = jax.random.gumbel(keys[0], (T, E))
  if name.endswith("_skewed"):
    g = g - 0.5 * jnp.log(jnp.arange(1, E + 1, dtype=jnp.float32))
  ids = jax.lax.top_k(g, k)[1].astype(jnp.int32)
  plc = permute.dropless_placement(ids, E, block_size=128)
  topo = make_topology(plc.group_sizes, plc.num_rows, 128, plc.tokens_per_expert)
  R = plc.num_rows
  active = real_rows(topo)[:, None]  # rows that hold no token are zero, as in the MoE layer
  x = jnp.where(active, jax.random.normal(keys[1], (R, d), dtype), 0)
  h = jnp.where(active, jax.random.normal(keys[2], (R, f), dtype), 0)
  w_in = (jax.random.normal(keys[3], (E, d, f), jnp.float32) / math.sqrt(d)).astype(dtype)
  w_out = (jax.random.normal(keys[4], (E, f, d), jnp.float32) / math.sqrt(f)).astype(dtype)
  return dict(T=T, d=d, f=f, E=E, k=k, N=T * k, topo=topo, x=x, h=h, w_in=w_in, w_out=w_out,
              group_sizes=plc.tokens_per_expert)


def products(p):
  """name -> (kind, lhs, rhs_or_dout, transpose_rhs, flops)."""
  N, d, f = p["N"], p["d"], p["f"]
  return {
      "x@Win": ("gmm", p["x"], p["w_in"], False, 2 * N * d * f),
      "h@Wout": ("gmm", p["h"], p["w_out"], False, 2 * N * d * f),
      "dh@Win^T": ("gmm", p["h"], p["w_in"], True, 2 * N * d * f),
      "x^T@dh": ("tgmm", p["x"], p["h"], False, 2 * N * d * f),
      "h^T@dy": ("tgmm", p["h"], p["x"], False, 2 * N * d * f),  # dW_out (x stands in for dY)
  }


def run_backend(kind, backend, lhs, other, topo, transpose_rhs, configs=None):
  if kind == "gmm":
    if backend == "mosaic":
      return jax.jit(lambda a, b: mosaic.gmm(a, b, topo, transpose_rhs, a.dtype, configs))
    return jax.jit(lambda a, b: triton.gmm(a, b, topo, transpose_rhs, a.dtype))
  if backend == "mosaic":
    return jax.jit(lambda a, b: mosaic.tgmm(a, b, topo, a.dtype, configs))
  return jax.jit(lambda a, b: triton.tgmm(a, b, topo, a.dtype))


def balanced(kind, p, lhs, other, transpose_rhs):
  """The same product on E equal groups of N/E rows: XLA's batched matmul, the ceiling."""
  E, N = p["E"], p["N"]
  a = lhs[: N].reshape(E, N // E, -1)
  if kind == "tgmm":
    b = other[: N].reshape(E, N // E, -1)
    return jax.jit(lambda a, b: jnp.einsum("ecd,ecf->edf", a, b)), (a, b)
  if transpose_rhs:
    return jax.jit(lambda a, w: jnp.einsum("ecf,edf->ecd", a, w)), (a, other)
  return jax.jit(lambda a, w: jnp.einsum("ecd,edf->ecf", a, w)), (a, other)


def ragged_dot_mgpu_fwd(p, lhs, rhs, transpose_rhs, cfg):
  """JAX's own Mosaic GPU ragged dot on the unpadded rows (forward only)."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

  bm, bn, bk, steps, gbn = cfg
  a = lhs[: p["N"]]
  fn = jax.jit(lambda a, b, gs: ragged_dot_mgpu.ragged_dot(
      a, b, group_sizes=gs, block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps,
      grid_block_n=gbn, transpose_rhs=transpose_rhs))
  return fn, (a, rhs, p["group_sizes"])


# (tile_n, tile_k, max_concurrent_steps, grid_minor_dim, grid_tile_width, epi_tile_n, delay_release)
MOSAIC_SWEEP = {
    "gmm": [(256, 64, 4, 0, 4, 64, 1), (256, 64, 4, 0, 8, 64, 1), (256, 64, 4, 1, 4, 64, 1),
            (256, 64, 4, 0, 4, 64, 0), (128, 64, 6, 0, 4, 64, 1)],
    "tgmm": [(128, 64, 4, 0, 1, 32, 1), (128, 64, 4, 0, 4, 32, 1), (128, 64, 4, 1, 1, 32, 1),
             (128, 128, 2, 0, 1, 32, 1), (64, 64, 6, 0, 1, 32, 1), (128, 64, 4, 0, 1, 32, 0),
             (128, 64, 4, 0, 2, 32, 1), (128, 64, 4, 0, 8, 32, 1), (128, 64, 4, 1, 4, 32, 1),
             (128, 64, 3, 0, 1, 64, 1), (128, 64, 4, 1, 8, 32, 1)],
}
RAGGED_MGPU_CONFIGS = [(64, 128, 64, 4, 1), (128, 128, 64, 4, 2), (128, 256, 64, 3, 4),
                       (128, 128, 128, 3, 8), (64, 256, 64, 4, 8)]


DENSE_SHAPES = [(20480, 1024, 4096), (20480, 4096, 1024)]  # E64 top-1's padded rows, x@Win and h@Wout


def dense_clusters():
  """hopper_matmul_mgpu on DENSE_SHAPES: CTA tile 128 x 256 as our gmm's (wg along M) and 128 x 256
  with wg along N, each without a cluster and with 2-CTA clusters along M (the B tile multicast)
  and N (the A tile multicast), beside cuBLAS (jnp.dot); every output checked against cuBLAS's."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as H

  D = H.MatmulDimension
  out = []
  for m, k, n in DENSE_SHAPES:
    a = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16)
    dot = jax.jit(jnp.dot)
    want, flops, op = dot(a, b), 2 * m * k * n, f"dense {m}x{k}x{n}"
    t = timeit(dot, a, b)
    out.append(dict(op=op, variant="cublas", ms=t * 1e3, tflops=flops / t / 1e12))
    log(f"{op} cublas {flops / t / 1e12:6.1f} TF/s")
    for cluster in (None, D.M, D.N):
      for wg, tile_m, tile_n in ((D.M, 64, 256), (D.N, 128, 128)):
        cfg = H.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=4,
                             epi_tile_n=64, epi_tile_m=64, grid_minor_dim=D.M, grid_tile_width=8,
                             wg_dimension=wg, cluster_dimension=cluster)
        variant = f"mgpu cluster={cluster} wg={wg}"
        rec = dict(op=op, variant=variant, config=str(cfg))
        try:
          fn = jax.jit(functools.partial(H.matmul, config=cfg))
          rec["rel_err"] = rel_err(fn(a, b, None), want)
          t = timeit(fn, a, b, None)
          rec.update(ms=t * 1e3, tflops=flops / t / 1e12)
          log(f"{op} {variant:28s} {rec['tflops']:6.1f} TF/s err {rec['rel_err']:.1e}")
        except Exception as e:  # noqa: BLE001 - a failing config is a result
          rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
          log(f"{op} {variant:28s} FAILED {rec['error'][:200]}")
        out.append(rec)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default=",".join(SHAPES))
  ap.add_argument("--ops", default="x@Win,h@Wout,dh@Win^T,x^T@dh,h^T@dy")
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--no-store", action="store_true", help="also time each gmm without its stores")
  ap.add_argument("--dense-clusters", action="store_true",
                  help="also time hopper_matmul_mgpu with cluster None/M/N against cuBLAS")
  ap.add_argument("--no-triton", action="store_true")
  ap.add_argument("--no-ragged-mgpu", action="store_true")
  ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
  args = ap.parse_args(argv)
  dev = jax.devices()[0]
  gpu = dev.device_kind.replace(" ", "_")
  log(f"jax {jax.__version__} on {dev.device_kind}, {getattr(dev, 'core_count', '?')} SMs")
  records = []
  for name in args.shapes.split(","):
    p = problem(name)
    log(f"\n=== {name}: N={p['N']} d={p['d']} f={p['f']} E={p['E']} rows={p['x'].shape[0]}")
    for op, (kind, lhs, other, tr, flops) in products(p).items():
      if op not in args.ops.split(","):
        continue
      # The float32 reference gathers a [blocks, K, N] weight copy: too big past a few GiB, where
      # the Triton backend (itself tested against the reference) stands in for it.
      if p["x"].shape[0] // 128 * p["d"] * p["f"] * 4 > 4 * 2**30:
        ref = run_backend(kind, "triton", lhs, other, p["topo"], tr)(lhs, other)
      elif kind == "gmm":
        ref = G.gmm_reference(lhs, other, p["topo"], tr)
      else:
        ref = G.tgmm_reference(lhs, other, p["topo"])

      # gmm leaves the rows of inactive blocks unwritten (the contract): compare real rows only.
      real = real_rows(p["topo"])[:, None]
      rows_of = (lambda o: jnp.where(real, o, 0)) if kind == "gmm" else (lambda o: o)

      def record(variant, fn, fargs, check=None, **extra):
        rec = dict(shape=name, op=op, variant=variant, **extra)
        try:
          out = fn(*fargs)
          if check is not False:
            check = check or rows_of
            rec["rel_err"] = rel_err(check(out), check(ref))
          t = timeit(fn, *fargs)
          rec.update(ms=t * 1e3, tflops=flops / t / 1e12)
          log(f"{op:9s} {variant:34s} {rec['tflops']:6.1f} TF/s  {t*1e3:7.3f} ms  "
              f"err {rec.get('rel_err', float('nan')):.1e}")
        except Exception as e:  # noqa: BLE001 - a failing config is a result
          rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
          log(f"{op:9s} {variant:34s} FAILED {rec['error'][:300]}")
        records.append(rec)
        return rec

      fn, fargs = balanced(kind, p, lhs, other, tr)
      record("balanced_bmm", fn, fargs, check=False)
      record("mosaic_default", run_backend(kind, "mosaic", lhs, other, p["topo"], tr), (lhs, other))
      if not args.no_triton:
        record("triton_default", run_backend(kind, "triton", lhs, other, p["topo"], tr), (lhs, other))
      if kind == "gmm" and not args.no_ragged_mgpu:
        rows = p["N"]
        for cfg in RAGGED_MGPU_CONFIGS:
          fn, fargs = ragged_dot_mgpu_fwd(p, lhs, other, tr, cfg)
          # Its rows are the unpadded sorted rows: check against the reference on the padded rows'
          # values is not direct, so check it against ragged_dot on the same inputs.
          want = jax.jit(lambda a, b, gs: jax.lax.ragged_dot(
              a, jnp.swapaxes(b, 1, 2) if tr else b, gs, preferred_element_type=jnp.float32))(*fargs)
          rec = dict(shape=name, op=op, variant=f"jax_ragged_dot_mgpu{list(cfg)}")
          try:
            got = fn(*fargs)
            rec["rel_err"] = rel_err(got, want)
            t = timeit(fn, *fargs)
            rec.update(ms=t * 1e3, tflops=2 * rows * lhs.shape[1] * (other.shape[1] if tr else other.shape[2]) / t / 1e12)
            log(f"{op:9s} {rec['variant']:34s} {rec['tflops']:6.1f} TF/s  {t*1e3:7.3f} ms  err {rec['rel_err']:.1e}")
          except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{op:9s} {rec['variant']:34s} FAILED {rec['error'][:200]}")
          records.append(rec)
      if args.no_store and kind == "gmm":
        stores = mosaic._store_tile
        mosaic._store_tile = lambda *a, **k: None  # traced anew by this jit only
        try:
          record("mosaic_no_store (ablation)", run_backend(kind, "mosaic", lhs, other, p["topo"], tr),
                 (lhs, other), check=False)
        finally:
          mosaic._store_tile = stores
      if args.sweep:
        # tgmm's three fields: which one a shape uses depends on its rows per expert (Configs.tgmm_for).
        fields = {"gmm": ("gmm_t",) if tr else ("gmm",), "tgmm": ("tgmm", "tgmm_long", "tgmm_short")}[kind]
        best = None
        for tn, tk, st, md, w, en, dl in MOSAIC_SWEEP[kind]:
          cfg = mosaic.Config(tile_n=tn, tile_k=tk, max_concurrent_steps=st, grid_minor_dim=md,
                              grid_tile_width=w, epi_tile_n=en, delay_release=dl)
          configs = dataclasses.replace(mosaic.DEFAULT_CONFIGS, **{f: cfg for f in fields})
          rec = record(f"mosaic{[tn, tk, st, md, w, en, dl]}",
                       run_backend(kind, "mosaic", lhs, other, p["topo"], tr, configs), (lhs, other),
                       config=dataclasses.asdict(cfg))
          if "tflops" in rec and rec.get("rel_err", 1) < 2e-2 and (best is None or rec["tflops"] > best["tflops"]):
            best = rec
        if best:
          log(f"BEST {name} {op}: {best['variant']} {best['tflops']:.1f} TF/s")
  if args.dense_clusters:
    records += dense_clusters()
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, f"gmm_kernels_{gpu}.json")
  with open(path, "w") as fh:
    json.dump(dict(gpu=gpu, jax=jax.__version__, records=records), fh, indent=1)
  copy_to_out(path)


if __name__ == "__main__":
  main()
