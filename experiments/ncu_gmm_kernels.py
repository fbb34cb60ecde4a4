"""One launch of each fused-MLP Hopper kernel on one shape, for Nsight Compute to read its counters.

The operands are built on the CPU and copied to the GPU, and the outputs are copied back and
checked on the CPU, so the four kernels below are the only GPU work in the process (each jitted
call pads nothing at these shapes). ncu stops the program once it has profiled --launch-count
kernels, so give it more than four:
  ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --launch-count 8 -o gmm python experiments/ncu_gmm_kernels.py
report i is the i-th kernel printed here; the last line printed is the check of every output
against the float32 reference (real rows). --smoke runs a small shape on the CPU (interpreted, in
about 10 s; on jax < 0.11 through the tests' interpreter shim: tune_gmm.interpret_compat).
"""
import argparse
import dataclasses
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import tune_gmm  # noqa: E402

from sparsejax.activations import DERIVATIVES  # noqa: E402
from sparsejax.kernels.gmm import mosaic  # noqa: E402
from sparsejax.kernels.gmm.reference import gmm_reference, real_rows  # noqa: E402

C = mosaic.Config
SMOKE_SHAPE = (300, 128, 256, 3, 1)  # T, d, f, E, k


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shape", default="XS_b128", choices=sorted(tune_gmm.SHAPES))
  ap.add_argument("--smoke", action="store_true", help="a small shape, interpreted on the CPU")
  args = ap.parse_args(argv)
  cpu = jax.devices("cpu")[0]
  device = cpu if args.smoke else jax.devices("gpu")[0]
  if args.smoke:
    tune_gmm.SHAPES["smoke"] = SMOKE_SHAPE
    tune_gmm.interpret_compat()  # without it jax 0.10's interpreter hangs in gmm_dact (W_out^T)
  with jax.default_device(cpu):
    p = tune_gmm.problem("smoke" if args.smoke else args.shape)
    pre = jax.random.normal(jax.random.key(3), p["h"].shape, jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(4), p["x"].shape, jnp.bfloat16)
  host = dict(topo=p["topo"], x=p["x"], h=p["h"], w_in=p["w_in"], w_out=p["w_out"], pre=pre, dy=dy)
  on = jax.device_put(host, device)
  topo = on["topo"]
  act = jax.nn.gelu
  d = None if args.smoke else mosaic.DEFAULT_CONFIGS  # the smoke run takes the interpreter's tiles
  wide = C(tile_n=256, max_concurrent_steps=4, epi_tile_n=32, epi_slots=4, grid_tile_width=8)
  wide_act = None if args.smoke else dataclasses.replace(d, gmm_act=wide, gmm_act_long=wide)
  kernels = [  # (name, function of arrays, its arrays): arguments, not constants captured by jit
      ("gmm_act x W_in (default: 128-wide tiles)", lambda a, b: mosaic.gmm_act(a, b, topo, act, d), ("x", "w_in")),
      ("gmm_act x W_in (256-wide tiles)", lambda a, b: mosaic.gmm_act(a, b, topo, act, wide_act), ("x", "w_in")),
      ("gmm h W_out", lambda a, b: mosaic.gmm(a, b, topo, False, jnp.bfloat16, d), ("h", "w_out")),
      ("gmm_dact dY W_out^T * act'(pre)", lambda a, b, c: mosaic.gmm_dact(a, b, topo, c, act, d),
       ("dy", "w_out", "pre")),
  ]
  outs = []
  for i, (name, fn, names) in enumerate(kernels):
    print(f"kernel {i}: {name}", flush=True)
    outs.append(jax.block_until_ready(jax.jit(fn)(*(on[n] for n in names))))
  outs = jax.device_put(outs, cpu)
  with jax.default_device(cpu):
    topo, x, h, w_out = host["topo"], host["x"], host["h"], host["w_out"]
    real = real_rows(topo)[:, None]
    on_real = lambda v: jnp.where(real, v.astype(jnp.float32), 0)
    ref_pre = gmm_reference(x, host["w_in"], topo)
    want = [act(ref_pre), act(ref_pre), gmm_reference(h, w_out, topo),
            gmm_reference(host["dy"], w_out, topo, transpose_rhs=True) * DERIVATIVES[act](pre.astype(jnp.float32))]
    got = [outs[0][1], outs[1][1], outs[2], outs[3]]
    errs = [tune_gmm.rel_err(on_real(g), on_real(w)) for g, w in zip(got, want, strict=True)]
  print("rel err against the float32 reference:", ", ".join(f"{e:.1e}" for e in errs), flush=True)
  if not all(e < 1e-2 for e in errs):
    raise SystemExit("a kernel's output is wrong")
  return errs


if __name__ == "__main__":
  main()
