"""Config sweep of the two fused-activation Mosaic kernels, gmm_act (x W_in -> pre, act(pre)) and
gmm_dact (dY W_out^T * act'(pre)), alone, every config's output checked against the float32
reference (reference.gmm_reference with the activation and its derivative applied in float32).

The expert MLP's products that write or read the pre-activation beside their output move twice
the bytes of a plain gmm, so their best ring depth and N tile differ from gmm's. Timer: tune_gmm.timeit.
Needs an sm_90 GPU:
  python experiments/tune_act_kernels.py --shapes XS_b128,E64_top1
Writes act_kernels_sweep.json under $OUT (or the current directory); shapes are tune_gmm.SHAPES.
"""
import argparse
import dataclasses
import functools
import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tune_gmm import problem, rel_err, timeit  # noqa: E402

from sparsejax.kernels.gmm import gmm_reference, mosaic  # noqa: E402
from sparsejax.kernels.gmm.reference import real_rows  # noqa: E402

C, M, N = mosaic.Config, mosaic.M_DIM, mosaic.N_DIM
PP = functools.partial(C, pingpong=True, tile_n=128, grid_tile_width=8, expert_bands=True)
# One ring for both consumers, as deep as fit_gmm allows (gmm_dact's pre tiles leave room for 4).
# Variants of the default (each kind's first row: 6 slots, 32-column pieces, bands of 8).
PINGPONG = [PP(tile_k=64, max_concurrent_steps=5, epi_tile_n=32),
            PP(tile_k=64, max_concurrent_steps=4, epi_tile_n=32),
            PP(tile_k=64, max_concurrent_steps=6, epi_tile_n=16),
            PP(tile_k=64, max_concurrent_steps=6, epi_tile_n=32, grid_tile_width=4)]
SWEEP = {
    "gmm_act": [
        mosaic.DEFAULT_CONFIGS.gmm_act,
        mosaic.COOPERATIVE_ACT,
        C(grid_tile_width=8, epi_slots=4, epi_tile_n=32),  # the default before this sweep
        C(grid_tile_width=8, epi_slots=2, epi_tile_n=64),
        C(grid_tile_width=8, epi_slots=4, epi_tile_n=64, max_concurrent_steps=3),
        C(grid_tile_width=8, epi_slots=8, epi_tile_n=32, max_concurrent_steps=3),
        C(tile_n=128, grid_tile_width=8, epi_slots=4, epi_tile_n=64),
        C(tile_n=128, tile_k=128, grid_tile_width=8, epi_slots=4, epi_tile_n=64, max_concurrent_steps=3),
        C(grid_tile_width=8, epi_slots=4, epi_tile_n=32, grid_minor_dim=N),
        C(grid_tile_width=8, epi_slots=4, epi_tile_n=32, delay_release=0),
        # Variants of the ping-pong default (mosaic_pingpong.gmm_padded: 128 x 128 tiles a
        # consumer, one ring for both, fit_gmm shrinking max_concurrent_steps to what fits).
        *PINGPONG],
    "gmm_dact": [
        mosaic.DEFAULT_CONFIGS.gmm_dact,
        mosaic.COOPERATIVE_DACT,
        C(tile_n=128, max_concurrent_steps=4, epi_tile_n=64, grid_tile_width=8),
        C(tile_n=128, max_concurrent_steps=5, epi_tile_n=32, grid_tile_width=8, epi_slots=4),
        C(tile_n=128, tile_k=128, max_concurrent_steps=3, epi_tile_n=64, grid_tile_width=8),
        C(tile_n=256, max_concurrent_steps=3, epi_tile_n=64, grid_tile_width=8),
        C(tile_n=128, max_concurrent_steps=5, epi_tile_n=64, grid_tile_width=8, grid_minor_dim=N),
        C(tile_n=64, max_concurrent_steps=6, epi_tile_n=64, grid_tile_width=8),
        *PINGPONG],
}


def sweep(shape: str, pingpong_only: bool = False) -> list[dict]:
  p = problem(shape)
  topo, x, w_in, w_out = p["topo"], p["x"], p["w_in"], p["w_out"]
  flops = 2 * p["N"] * p["d"] * p["f"]
  act = jax.nn.gelu
  real = real_rows(topo)[:, None]
  dy = jnp.where(real, jax.random.normal(jax.random.key(9), x.shape, x.dtype), 0)
  pre32 = jax.jit(lambda a, b: gmm_reference(a, b, topo, out_dtype=jnp.float32))(x, w_in)
  pre = pre32.astype(x.dtype)  # gmm_dact's input, as the MLP's forward stores it
  want_h = act(pre32)
  dact = jax.grad(lambda v: jnp.sum(act(v)))(pre.astype(jnp.float32))
  want_d = jax.jit(lambda a, b: gmm_reference(a, b, topo, True, jnp.float32))(dy, w_out) * dact
  err = lambda got, want: rel_err(jnp.where(real, got, 0), jnp.where(real, want, 0))

  out = []
  for kind, cfgs in SWEEP.items():
    for cfg in ([*cfgs[:2], *PINGPONG] if pingpong_only else cfgs):
      # The _long config too: gmm_for picks it at LONG_ROWS rows an expert.
      configs = dataclasses.replace(mosaic.DEFAULT_CONFIGS, **{kind: cfg},
                                    **{f"{kind}_long": cfg})
      if kind == "gmm_act":
        fn, args = jax.jit(lambda a, b, c=configs: mosaic.gmm_act(a, b, topo, act, c)[1]), (x, w_in)
      else:
        fn, args = jax.jit(lambda a, b, q, c=configs: mosaic.gmm_dact(a, b, topo, q, act, c)), (dy, w_out, pre)
      rec = dict(shape=shape, kind=kind, config=dataclasses.asdict(cfg))
      try:
        rec["rel_err"] = err(fn(*args), want_h if kind == "gmm_act" else want_d)
        t = timeit(fn, *args)
        rec.update(ms=t * 1e3, tflops=flops / t / 1e12)
        print(f"{shape} {kind} {rec['ms']:.3f} ms {rec['tflops']:.0f} TF/s err {rec['rel_err']:.1e} {cfg}", flush=True)
      except Exception as e:  # noqa: BLE001 - a config that fails is a result
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"{shape} {kind} FAILED {rec['error'][:200]} {cfg}", flush=True)
      out.append(rec)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="XS_b128,E64_top1")
  ap.add_argument("--pingpong-only", action="store_true",
                  help="each kind's default and cooperative configs and the ping-pong ones only")
  args = ap.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  records = [r for s in args.shapes.split(",") for r in sweep(s, args.pingpong_only)]
  with open(os.path.join(os.environ.get("OUT", "."), "act_kernels_sweep.json"), "w") as fh:
    json.dump(records, fh, indent=1)


if __name__ == "__main__":
  main()
