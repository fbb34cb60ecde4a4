"""Epilogue buffering against ring depth for the Mosaic gmm / gmm_act kernels (issue 9's probe).

The expert MLP's forward and fwd+bwd on the bench's shapes under several `mosaic.Configs`: more
epilogue slots (a consumer writes a whole tile into shared memory without waiting on a TMA store)
paid for with a shallower ring. Every variant, torch_grouped_mm first, is timed with the bench's
timer in the same run and checked against the float32 reference. Needs an sm_90 GPU:
  python experiments/tune_epilogue_slots.py --shapes E64_top1,E64_top1_skewed,E64_top8
Writes epilogue_slots.json under $OUT (or the current directory).
"""
import argparse
import dataclasses
import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import bench_moe_layer  # noqa: E402
from peers import common, sparsejax_variants, torch_grouped_mm  # noqa: E402

from sparsejax.kernels.gmm import mosaic  # noqa: E402

R = dataclasses.replace
# Variants change the current defaults. results/epilogue_slots_H100.log was measured when gmm_act's
# default was 256-wide N tiles with 4 epilogue slots of 32 columns (now 128-wide, 6 stages).
BASE = mosaic.Configs()


def act(**changes) -> dict:
  """gmm_act's tiles changed for every row count (gmm_act_long serves experts of LONG_ROWS rows or more)."""
  cfg = R(BASE.gmm_act, **changes)
  return dict(gmm_act=cfg, gmm_act_long=cfg)


VARIANTS = {
    "default": BASE,
    "gmm s3e64x4": R(BASE, gmm=R(BASE.gmm, max_concurrent_steps=3, epi_slots=4)),
    "gmm s4e32x4": R(BASE, gmm=R(BASE.gmm, epi_tile_n=32, epi_slots=4)),
    "act s3e64x4": R(BASE, **act(max_concurrent_steps=3, epi_tile_n=64, epi_slots=4)),
    "act s3e32x8": R(BASE, **act(max_concurrent_steps=3, epi_tile_n=32, epi_slots=8)),
    "act s2e64x8": R(BASE, **act(max_concurrent_steps=2, epi_tile_n=64, epi_slots=8)),
    "both s3 x4": R(BASE, gmm=R(BASE.gmm, max_concurrent_steps=3, epi_slots=4),
                    **act(max_concurrent_steps=3, epi_tile_n=64, epi_slots=4)),
    "gmm_t s3e64x4": R(BASE, gmm_t=R(BASE.gmm_t, max_concurrent_steps=3, epi_slots=4)),
}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="E64_top1,E64_top1_skewed,E64_top8")
  args = ap.parse_args(argv)
  shapes = [s for s in bench_moe_layer.SHAPES if s.name in args.shapes.split(",")]
  timer, out = common.Timer(), []
  path = os.path.join(os.environ.get("OUT", "."), "epilogue_slots.json")
  for s in shapes:
    p = common.make_problem(s)
    ref = common.dropless_reference(p)
    print(f"=== {s.name}", flush=True)
    cases = [("torch_grouped_mm", None, lambda: torch_grouped_mm.torch_grouped_mm(p, ref))] + [
        (name, cfgs, lambda: sparsejax_variants.sparsejax_case(p, ref, "mosaic"))
        for name, cfgs in VARIANTS.items()]
    for name, cfgs, make in cases:
      mosaic.DEFAULT_CONFIGS = cfgs or BASE  # read at call time: the next trace uses it
      case = make()
      chk = case.check()
      n, tf, tb = case.useful_rows, timer(case.fwd, case.sync), timer(case.fwdbwd, case.sync)
      rec = dict(shape=s.name, variant=name, fwd_tflops=4 * n * s.d * s.f / tf["median_s"] / 1e12,
                 fwdbwd_tflops=12 * n * s.d * s.f / tb["median_s"] / 1e12, ok=chk["check_ok"],
                 rel_err=chk["rel_err"], grad=max(chk.get("grad_rel_err") or [0]))
      print(f"{name:16s} fwd {rec['fwd_tflops']:6.1f} fwd+bwd {rec['fwdbwd_tflops']:6.1f} TF/s ok={rec['ok']} "
            f"err {rec['rel_err']:.1e} grad {rec['grad']:.1e}", flush=True)
      out.append(rec)
      with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
      if cfgs is None:
        torch_grouped_mm.release()  # before JAX's allocator grows into the memory torch holds
    mosaic.DEFAULT_CONFIGS = BASE


if __name__ == "__main__":
  main()
