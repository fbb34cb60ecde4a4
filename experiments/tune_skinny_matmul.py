"""Sweep skinny_matmul's Pallas Triton configs on one GPU against XLA's own one-row dot.

For each product of a medium decode step (x [1, K] against a bf16 weight [K, N]: the attention's
qkv and output projections, the MLP's up and down), every variant is checked against a float32 numpy
product, then timed by its kernels' device time under jax.profiler (the sum of the durations of the
kernels one call runs, the split-K partial sum included), best of three: in a decode step the calls
run back to back in one CUDA graph, so launch overhead is not what separates them. Each call chains
48 products over 48 distinct weights (no weight reused from L2).

  python experiments/tune_skinny_matmul.py            # GPU: the sweep, the best five per shape
  python experiments/tune_skinny_matmul.py --smoke    # any backend: one small shape, interpret mode

Writes experiments/results/skinny_matmul_sweep_<gpu>.json (and a copy under $OUT when set).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from sparsejax.kernels.skinny_matmul import triton  # noqa: E402
from out_dir import copy_to_out  # noqa: E402

SHAPES = [(1024, 4096), (4096, 1024), (1024, 3072), (1024, 1024)]


def configs(k: int, n: int) -> list[triton.Config]:
  out = []
  for use_dot in (False, True):
    for block_n in (64, 128, 256):
      for rows in (128, 256, 512):
        if k % rows or n % block_n:
          continue
        for warps in ((4, 8) if rows >= 256 else (4,)):
          out.append(triton.Config(block_n=block_n, block_k=min(rows, 128), rows_per_program=rows,
                                   use_dot=use_dot, num_warps=warps))
  return out


def device_us(f, *args) -> tuple[float, int]:
  """(summed kernel microseconds of one call, kernels per call), best of three traced calls."""
  if jax.default_backend() != "gpu":
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return 1e6 * (time.perf_counter() - t0), 0
  from profile_step import load_trace, stream_kernels
  jax.block_until_ready(f(*args))
  best = None
  for _ in range(3):
    log_dir = tempfile.mkdtemp()
    with jax.profiler.trace(log_dir):
      jax.block_until_ready(f(*args))
    kernels = stream_kernels(load_trace(log_dir))
    shutil.rmtree(log_dir, ignore_errors=True)
    total = sum(e["dur"] for e in kernels)
    best = (total, len(kernels)) if best is None or total < best[0] else best
  return best


def sweep(shapes, chain: int, limit: int | None) -> list[dict]:
  interpret = jax.default_backend() != "gpu"
  rows = []
  for k, n in shapes:
    ws = tuple(jax.random.normal(jax.random.key(10 + i), (k, n), jnp.bfloat16) for i in range(chain))
    x = jax.random.normal(jax.random.key(2), (1, k), jnp.bfloat16)
    want = np.stack([np.asarray(x[0], np.float32) @ np.asarray(w, np.float32) for w in ws])
    variants = {"xla_dot": lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)}
    for cfg in configs(k, n)[:limit]:
      name = (f"pallas_{'dot' if cfg.use_dot else 'mulsum'}_n{cfg.block_n}_rows{cfg.rows_per_program}"
              f"_w{cfg.num_warps}")
      variants[name] = (lambda cfg: lambda x, w: triton.skinny_matmul_parts(
          (x,), triton.Plain(per_slot=False), w[None], jnp.zeros((1,), jnp.int32), 1, x.dtype, cfg,
          interpret=interpret)[0].sum(axis=0)[:1])(cfg)
    for name, f in variants.items():
      g = jax.jit(lambda x, ws, f=f: jnp.stack([f(x, w)[0] for w in ws]))
      row = dict(k=k, n=n, variant=name)
      try:
        got = np.asarray(g(x, ws))
        row["rel_err"] = float(np.abs(got - want).max() / np.abs(want).max())
        assert row["rel_err"] < 1e-2, f"{name}: rel err {row['rel_err']:.2e}"
        us, launched = device_us(g, x, ws)
        row.update(us=us / chain, GBps=chain * k * n * 2 / us / 1e3, kernels=launched / chain)
      except Exception as e:  # noqa: BLE001 - one failing config must not lose the others
        row["error"] = f"{type(e).__name__}: {e}"[:300]
      rows.append(row)
      print(row, flush=True)
    timed = sorted((r for r in rows if r["k"] == k and r["n"] == n and "us" in r), key=lambda r: r["us"])
    print(f"best for [{k}, {n}]: " + ", ".join(f"{r['variant']} {r['us']:.2f} us ({r['GBps']:.0f} GB/s)"
                                              for r in timed[:5]), flush=True)
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--smoke", action="store_true", help="one small shape, two configs (runs on a CPU)")
  ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
  args = ap.parse_args(argv)
  if args.smoke:
    rows = sweep([(256, 128)], chain=2, limit=2)
  else:
    rows = sweep(SHAPES, chain=48, limit=None)
  if args.smoke:
    return rows
  name = f"skinny_matmul_sweep_{jax.devices()[0].device_kind.replace(' ', '_')}.json"
  path = os.path.join(args.out_dir, name)
  with open(path, "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)
  copy_to_out(path)
  return rows


if __name__ == "__main__":
  main()
