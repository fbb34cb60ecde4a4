"""Sweep skinny_matmul's Pallas Triton configs on one GPU against XLA's own one-row dot.

For each product of a medium decode step (x [m, K], one row by default, against a weight [K, N]: the
attention's qkv and output projections, the MLP's up and down), every variant is checked against a
float32 product at HIGHEST precision, then timed by its kernels' device time under jax.profiler (the
sum of the durations of the kernels one call runs, the split-K partial sum included), best of three:
in a decode step the calls run back to back in one CUDA graph, so launch overhead is not what
separates them. Each call chains 48 products (--chain) over distinct weights (no weight reused from
L2); --slots runs each product through that many experts in one kernel, as a decode step's MoE layer.

  python experiments/tune_skinny_matmul.py            # GPU: the sweep, the best five per shape
  python experiments/tune_skinny_matmul.py --rows 32 --slots 22 --chain 8 --int8 --shapes 1024x4096
                                                      # batch 32's expert products, int8 weights
  python experiments/tune_skinny_matmul.py --int8 --k-steps --chain 24 --shapes 1024x4096,4096x1024
                                                      # one row, int8, the K rows a program reads at a time
  python experiments/tune_skinny_matmul.py --smoke    # any backend: one small shape, interpret mode

int8 weights enter the kernel as stored, k-major ([slots, n, k], as quantize_weight stores them), and are
converted where they are loaded, as in the decode step
(the per-column scale multiplies the result outside the kernel, so it is left out here). Writes
experiments/results/skinny_matmul_sweep_<gpu>[_m<rows>][_s<slots>][_int8][_ksteps].json (and a copy under $OUT when set).
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
from sparsejax.kernels.skinny_matmul.reference import k_major  # noqa: E402
from out_dir import copy_to_out  # noqa: E402

SHAPES = [(1024, 4096), (4096, 1024), (1024, 3072), (1024, 1024)]


def configs(m: int, k: int, n: int, k_steps: bool = False, forms: bool = False,
            int8: bool = False) -> list[triton.Config]:
  """One row: both forms over 32-256 columns and 128-512 K rows. More rows take the dot form only (the
  multiply-reduce computes one row), over 64-256 columns and 256-4096 K rows. Each program reads its rows
  128 at a time (block_k); k_steps (one row): 64-128 columns, 128-1024 rows read in steps of 128-512.
  forms: the tiles default_config picks at these sizes, and the 128-column tiles of 512-2048 rows, each read
  128 or 256 K rows at a time through a 3- or 4-deep pipeline (each int8 multiply-reduce twice: see sweep)."""
  out = []
  if forms:
    tiles = {(c.block_n, c.rows_per_program, c.use_dot) for c in (
        [triton.default_config(m, k, n, slots) for slots in (1, 22)]
        + [triton.Config(block_n=128, block_k=128, rows_per_program=r, use_dot=True) for r in (512, 1024, 2048)])
        if c is not None and k % c.rows_per_program == 0 and n % c.block_n == 0}
    for block_n, rows, use_dot in sorted(tiles):
      for block_k in (128, 256):
        for stages in (3, 4):
          if rows % block_k == 0:
            out.append(triton.Config(block_n=block_n, block_k=block_k, rows_per_program=rows, use_dot=use_dot,
                                     num_stages=stages))
    return out
  if k_steps:
    for use_dot in (False, True):
      for block_n in (64, 128):
        for rows, block_k in ((128, 128), (256, 128), (256, 256), (512, 256), (512, 512), (1024, 256), (1024, 512)):
          if k % rows or n % block_n:
            continue
          for warps in (4, 8):
            out.append(triton.Config(block_n=block_n, block_k=block_k, rows_per_program=rows, use_dot=use_dot,
                                     num_warps=warps))
    return out
  wide = m > 1
  for use_dot in ((True,) if wide else (False, True)):
    for block_n in (64, 128, 256) if wide else (32, 64, 128, 256):
      for rows in ((256, 512, 1024, 2048, 4096) if wide else (128, 256, 512)):
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


def weights(slots: int, k: int, n: int, chain: int, int8: bool) -> tuple:
  """chain distinct expert weights: bf16 normals [slots, k, n], or int8 drawn uniformly from [-127, 127], stored
  k-major as the library stores int8 ([slots, n, k]; as_kn gives the [slots, k, n] product's view)."""
  if int8:
    return tuple(jax.random.randint(jax.random.key(10 + i), (slots, n, k), -127, 128, jnp.int32).astype(jnp.int8)
                 for i in range(chain))
  return tuple(jax.random.normal(jax.random.key(10 + i), (slots, k, n), jnp.bfloat16) for i in range(chain))


def as_kn(w):
  """A weight as the product reads it, [.., k, n], whichever way it is stored (skinny_matmul.reference.k_major)."""
  return jnp.swapaxes(w, -1, -2) if k_major(w.dtype) else w


def with_float_bits(on: bool, fn):
  """fn() traced with skinny_matmul's int8 conversion by float bits (a multiply-reduce's) on or off (the switch is
  a key of its shared lowering)."""
  saved, triton.INT8_FLOAT_BITS = triton.INT8_FLOAT_BITS, on
  try:
    return fn()
  finally:
    triton.INT8_FLOAT_BITS = saved


def sweep(shapes, chain: int, limit: int | None, m: int = 1, int8: bool = False, slots: int = 1,
          k_steps: bool = False, forms: bool = False) -> list[dict]:
  """Each call: x [m, k] through `slots` experts of [k, n] (one kernel, as decode_moe runs a step's distinct
  experts), chained over `chain` distinct weights."""
  interpret = jax.default_backend() != "gpu"
  rows = []
  ids = jnp.arange(slots, dtype=jnp.int32)
  for k, n in shapes:
    ws = weights(slots, k, n, chain, int8)
    x = jax.random.normal(jax.random.key(2), (m, k), jnp.bfloat16)
    exact = jax.jit(lambda x, ws: jnp.stack([jnp.einsum("mk,skn->smn", x.astype(jnp.float32),
                                                        as_kn(w).astype(jnp.float32),
                                                        precision="highest") for w in ws]))
    want = np.asarray(exact(x, ws))
    variants = {"xla_dot": lambda x, w: jnp.einsum("mk,skn->smn", x, as_kn(w).astype(x.dtype),
                                                   preferred_element_type=jnp.float32)}
    # forms with int8 weights: each multiply-reduce config with the cast and with the float bits (_magic); the
    # dot form always casts.
    for cfg in configs(m, k, n, k_steps, forms, int8)[:limit]:
      for magic in ((False, True) if forms and int8 and not cfg.use_dot else (None,)):
        name = (f"pallas_{'dot' if cfg.use_dot else 'mulsum'}_n{cfg.block_n}_rows{cfg.rows_per_program}"
                + (f"_bk{cfg.block_k}" if k_steps or forms else "") + f"_w{cfg.num_warps}"
                + (f"_s{cfg.num_stages}" if cfg.num_stages != 3 else "") + ("_magic" if forms and magic else ""))
        product = (lambda cfg: lambda x, w: triton.skinny_matmul_parts(
            (x,), triton.Plain(per_slot=False), w, ids, m, x.dtype, cfg, interpret=interpret).sum(axis=1)[:, :m])(cfg)
        variants[name] = product if magic is None else (
            lambda product, magic: lambda x, w: with_float_bits(magic, lambda: product(x, w)))(product, magic)
    for name, f in variants.items():
      g = jax.jit(lambda x, ws, f=f: jnp.stack([f(x, w) for w in ws]))
      row = dict(m=m, k=k, n=n, slots=slots, weight="int8" if int8 else "bf16", variant=name)
      try:
        got = np.asarray(g(x, ws))
        row["rel_err"] = float(np.abs(got - want).max() / np.abs(want).max())
        assert row["rel_err"] < 1e-2, f"{name}: rel err {row['rel_err']:.2e}"
        us, launched = device_us(g, x, ws)
        row.update(us=us / chain, GBps=chain * ws[0].nbytes / us / 1e3, kernels=launched / chain)
      except Exception as e:  # noqa: BLE001 - one failing config must not lose the others
        row["error"] = f"{type(e).__name__}: {e}"[:300]
      rows.append(row)
      print(row, flush=True)
    timed = sorted((r for r in rows if r["k"] == k and r["n"] == n and "us" in r), key=lambda r: r["us"])
    print(f"best for [{k}, {n}]: " + ", ".join(f"{r['variant']} {r['us']:.2f} us ({r['GBps']:.0f} GB/s)"
                                              for r in timed[:5]), flush=True)
  return rows


def parse_shapes(ap: argparse.ArgumentParser, text: str | None, default: list) -> list[tuple[int, int]]:
  """--shapes' comma-separated KxN pairs (default when not given); a malformed one is the parser's error."""
  try:
    return default if text is None else [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
  except ValueError:
    ap.error(f"--shapes takes comma-separated KxN pairs, e.g. 1024x4096; got {text!r}")


def save(rows: list[dict], out_dir: str, stem: str, suffix: str) -> str:
  """rows as <out_dir>/<stem>_<gpu><suffix>.json with the device and jax version (copied under $OUT when set)."""
  kind = jax.devices()[0].device_kind
  path = os.path.join(out_dir, f"{stem}_{kind.replace(' ', '_')}{suffix}.json")
  with open(path, "w") as f:
    json.dump(dict(device=kind, jax=jax.__version__, rows=rows), f, indent=1)
  copy_to_out(path)
  return path


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--smoke", action="store_true", help="one small shape, two configs (runs on a CPU)")
  ap.add_argument("--rows", type=int, default=1, help="m, the rows of x (at most skinny_matmul.MAX_ROWS)")
  ap.add_argument("--int8", action="store_true", help="int8 weights, cast where the kernel loads them")
  ap.add_argument("--slots", type=int, default=1, help="experts a call reads (one kernel over all of them)")
  ap.add_argument("--chain", type=int, default=48, help="calls chained over distinct weights")
  ap.add_argument("--k-steps", action="store_true",
                  help="one row: sweep the K rows a program reads at a time (block_k) too")
  ap.add_argument("--forms", action="store_true",
                  help="the default and 128-column tiles, 128 or 256 K rows a step, 3 or 4 stages; "
                       "int8 by cast and by float bits")
  ap.add_argument("--shapes", default=None, help="comma-separated KxN (default: a medium decode step's)")
  ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
  args = ap.parse_args(argv)
  if not 1 <= args.rows <= 64:
    ap.error(f"--rows must be in [1, 64]; got {args.rows}")
  if args.k_steps and args.rows != 1:
    ap.error("--k-steps sweeps the one-row tiles: drop --rows")
  shapes = parse_shapes(ap, args.shapes, SHAPES)
  if args.smoke:
    return sweep([(256, 128)], chain=2, limit=2, m=args.rows, int8=args.int8, slots=args.slots,
                 k_steps=args.k_steps, forms=args.forms)
  rows = sweep(shapes, chain=args.chain, limit=None, m=args.rows, int8=args.int8, slots=args.slots,
               k_steps=args.k_steps, forms=args.forms)
  suffix = (f"_m{args.rows}" if args.rows > 1 else "") + (f"_s{args.slots}" if args.slots > 1 else "") + (
      "_int8" if args.int8 else "") + ("_ksteps" if args.k_steps else "") + ("_forms" if args.forms else "")
  save(rows, args.out_dir, "skinny_matmul_sweep", suffix)
  return rows


if __name__ == "__main__":
  main()
