"""The grouped products under routing skew: how the time of gmm and tgmm grows as the tokens
crowd onto a few experts, at one MoE-XS layer's shape and 128 x 1024 tokens (tune_gmm's XS_b128).

A training run's routing starts far from uniform: at initialization, MoE-XS on the built-in
corpus sends 22-35x the mean number of tokens to its busiest expert, and 32-52 of its 64
experts get none (every layer). gmm's work items are 128-row blocks, whatever their expert, but
tgmm's are (expert, output tile) pairs whose reduction runs over all of the expert's rows, so a
crowded expert's few tiles can outlast the rest of the grid. This measures it: routing drawn as
argmax(gumbel + b_e) with per-expert biases b_e ~ N(0, sigma), one row per sigma, each product's
median time (tune_gmm.timeit; the median of --rounds rounds that alternate the variants) and the
busiest expert's share, tgmm in its default tile order (heaviest experts first, every second wave
reversed: mosaic.py) and in expert order, both in the same run. Outputs are checked against the
reference at every sigma.

  python experiments/bench_gmm_skew.py                       # sigmas 0, 0.5, 1, 2, 3
  python experiments/bench_gmm_skew.py --sigmas 0,3 --smoke  # small shape, one timed call: checks the script
(the smoke run interprets the kernels off a GPU, in seconds; its transposed wgmma operands need
jax >= 0.11's GPU interpreter, or the tests' mosaic_interpret_compat shim, which it takes on older
jax: tune_gmm.interpret_compat)

Writes gmm_skew_<gpu>.json (gmm_skew_<gpu>_smoke.json with --smoke) under --out-dir ($OUT when set,
else experiments/results/).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsejax import permute  # noqa: E402
from sparsejax.kernels.gmm import mosaic, reference  # noqa: E402
from sparsejax.topology import make_topology  # noqa: E402
from tune_gmm import interpret_compat, log, rel_err, timeit  # noqa: E402

XS_B128 = (131072, 512, 2048, 64)  # T, d, f, E (top-1)
SMOKE = (512, 128, 256, 8)


def skewed_problem(shape, sigma, seed=0, dtype=jnp.bfloat16):
  T, d, f, E = shape
  keys = jax.random.split(jax.random.key(seed), 6)
  bias = sigma * jax.random.normal(keys[5], (E,))
  ids = jnp.argmax(jax.random.gumbel(keys[0], (T, E)) + bias, axis=1).astype(jnp.int32)[:, None]
  plc = permute.dropless_placement(ids, E, block_size=128)
  topo = make_topology(plc.group_sizes, plc.num_rows, 128, plc.tokens_per_expert)
  real = reference.real_rows(topo)[:, None]
  x = jnp.where(real, jax.random.normal(keys[1], (plc.num_rows, d), dtype), 0)
  h = jnp.where(real, jax.random.normal(keys[2], (plc.num_rows, f), dtype), 0)
  w_in = (jax.random.normal(keys[3], (E, d, f), jnp.float32) / math.sqrt(d)).astype(dtype)
  counts = np.asarray(plc.tokens_per_expert)
  return dict(topo=topo, x=x, h=h, w_in=w_in, counts=counts, real=real)


def tgmm_by_blocks(lhs, dout, topo):
  """reference.tgmm_reference's sum, one block at a time: [blocks, k, n] outer products summed per
  expert (the padding rows are zero here), without its [rows, experts] one-hot contraction."""
  a = lhs.astype(jnp.float32).reshape(topo.num_row_blocks, topo.block_size, -1)
  b = dout.astype(jnp.float32).reshape(topo.num_row_blocks, topo.block_size, -1)
  per_block = jnp.einsum("bmk,bmn->bkn", a, b, precision=jax.lax.Precision.HIGHEST)
  return jax.ops.segment_sum(per_block, topo.row_block_expert, topo.num_experts)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--sigmas", default="0,0.5,1,2,3")
  ap.add_argument("--smoke", action="store_true", help="a small shape, one round of one timed call each")
  ap.add_argument("--rounds", type=int, default=3, help="timing rounds over all variants; the median is kept")
  ap.add_argument("--out-dir", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
  args = ap.parse_args(argv)
  # Interpreted (off a GPU) a call takes ~0.5 s: the smoke run times one call a variant, once.
  timing = dict(warmup=0, iters=1, reps=1) if args.smoke else {}
  if args.smoke:
    args.rounds = 1
  interpret_compat()  # off a GPU on jax < 0.11, without it the interpreter hangs in tgmm (x^T)
  shape = SMOKE if args.smoke else XS_B128
  T, d, f, E = shape
  flops = 2 * T * d * f
  # The A/B peer: tgmm walking the experts in index order (Config.balance_experts=False).
  base = mosaic.DEFAULT_CONFIGS if jax.default_backend() == "gpu" else mosaic.INTERPRET_CONFIGS
  expert_order = base.with_tgmm(balance_experts=False)
  rows = []
  log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; T={T} d={d} f={f} E={E} top-1")
  for sigma in map(float, args.sigmas.split(",")):
    p = skewed_problem(shape, sigma)
    topo, x, h, w_in, counts, real = (p[n] for n in ("topo", "x", "h", "w_in", "counts", "real"))
    # gmm leaves the padding rows of inactive blocks unwritten (op.py's contract): compare real rows.
    real_rows = lambda y: jnp.where(real, y, 0)
    fns = {
        "gmm x W_in": (jax.jit(lambda a, b: mosaic.gmm(a, b, topo, False, a.dtype)),
                       lambda a, b: real_rows(reference.gmm_reference(a, b, topo, False, jnp.float32)),
                       (x, w_in), real_rows),
        "tgmm x^T h (dW_in)": (jax.jit(lambda a, b: mosaic.tgmm(a, b, topo, a.dtype)),
                               lambda a, b: tgmm_by_blocks(a, b, topo), (x, h), lambda y: y),
        "tgmm, expert order": (jax.jit(lambda a, b: mosaic.tgmm(a, b, topo, a.dtype, expert_order)),
                               lambda a, b: tgmm_by_blocks(a, b, topo), (x, h), lambda y: y),
    }
    rec = dict(sigma=sigma, max_over_mean=float(counts.max() / counts.mean()),
               empty_experts=int((counts == 0).sum()), busiest_share=float(counts.max() / T))
    errs = {}
    for name, (fn, ref, operands, checked) in fns.items():
      errs[name] = rel_err(checked(fn(*operands)), jax.jit(ref)(*operands))
      if errs[name] > 2e-2:
        raise SystemExit(f"{name} at sigma {sigma}: rel err {errs[name]:.1e} against the reference")
    # Rounds that alternate the variants: the H100's clock drifts by up to ~10% over a minute of
    # back-to-back kernels, which a single pass would charge to whichever variant ran last.
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
      for name, (fn, _, operands, _) in fns.items():
        times[name].append(1e3 * timeit(fn, *operands, **timing))
    for name, t in times.items():
      ms = float(np.median(t))
      rec[name] = dict(ms=ms, tflops=flops / ms / 1e9, rel_err=errs[name], rounds_ms=t)
    rows.append(rec)
    log(f"sigma {sigma:3.1f}: busiest expert {rec['max_over_mean']:5.1f}x the mean "
        f"({100 * rec['busiest_share']:4.1f}% of tokens), {rec['empty_experts']:2d} empty | "
        + " | ".join(f"{n} {rec[n]['ms']:.3f} ms ({rec[n]['tflops']:.0f} TF/s)" for n in fns))
  name = jax.devices()[0].device_kind.replace(" ", "_") + ("_smoke" if args.smoke else "")
  os.makedirs(args.out_dir, exist_ok=True)
  with open(os.path.join(args.out_dir, f"gmm_skew_{name}.json"), "w") as fh:
    json.dump(dict(shape=dict(T=T, d=d, f=f, E=E, k=1), jax=jax.__version__, smoke=args.smoke, rows=rows), fh,
              indent=1)
  return rows


if __name__ == "__main__":
  main()
