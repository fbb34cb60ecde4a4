"""The activation epilogues alone, against a gmm and a separate XLA pass, and their config sweep.

  python experiments/tune_activation_fusion.py E64_top1,E8_top2,E64_top8

Per shape (tune_gmm.py's problems, placed as moe_mlp places them): x W_in then gelu (gmm_in+gelu)
against gmm_act (one kernel writing pre and gelu(pre)), and dY W_out^T times gelu'(pre)
(gmm_t+dgelu) against gmm_dact, each over a few Mosaic configs. Every fused output is checked
against the unfused one (err_*, check_ok). The problem's x rows stand in for dY (both [rows, d],
zero past the real rows). Timer: tune_gmm.timeit. The defaults in sparsejax/kernels/gmm/mosaic.py
came from this sweep (log: experiments/results/activation_fusion_H100.log).
"""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
from tune_gmm import problem, rel_err, timeit  # noqa: E402

from sparsejax.activations import DERIVATIVES  # noqa: E402
from sparsejax.kernels.gmm import mosaic  # noqa: E402
from sparsejax.kernels.gmm.reference import real_rows  # noqa: E402

GELU = jax.nn.gelu
TOL = 1e-2  # bf16 outputs of two float32-accumulated paths

GMM_ACT_CONFIGS = [mosaic.Config(grid_tile_width=8, epi_slots=4, epi_tile_n=32),
                   mosaic.Config(grid_tile_width=8, epi_slots=4, epi_tile_n=64),
                   mosaic.Config(grid_tile_width=8, epi_slots=3, epi_tile_n=64, max_concurrent_steps=3)]
GMM_CONFIGS = [mosaic.Config(epi_slots=4, epi_tile_n=32), mosaic.Config(epi_slots=4, epi_tile_n=64)]
GMM_DACT_CONFIGS = [mosaic.Config(max_concurrent_steps=3, epi_tile_n=32),
                    mosaic.Config(max_concurrent_steps=3, epi_tile_n=32, epi_slots=3),
                    mosaic.Config(tile_n=128, max_concurrent_steps=5, epi_tile_n=64, grid_tile_width=8)]


def _tag(kind, c):
  return (f"{kind} n{c.tile_n} k{c.tile_k} s{c.max_concurrent_steps} e{c.epi_tile_n} "
          f"slots{c.epi_slots} w{c.grid_tile_width}")


def _variant(r, tag, fn, args, want, pick=lambda out: out, mask=lambda v: v):
  """Time fn(*args) into r[tag] and its error against want into r['err ' + tag], both through
  mask (on_real_rows: the kernels leave inactive blocks' rows unwritten)."""
  try:
    got = fn(*args)
    r[tag] = timeit(fn, *args)
    r["err " + tag] = rel_err(mask(pick(got)), mask(want))
  except Exception as e:  # a config that does not compile is a result of the sweep
    r[tag] = f"FAILED {type(e).__name__}: {str(e)[:200]}"


def on_real_rows(topo):
  """v with the rows that hold no token zeroed (arrays of the buffer's rows; others as they are):
  the Hopper kernels leave inactive blocks' rows unwritten, so only the real rows compare."""
  real = real_rows(topo)[:, None]
  return lambda v: jnp.where(real, v, 0) if v.shape[0] == real.shape[0] else v


def shape_results(name):
  p = problem(name)
  topo, x, w_in, w_out = p["topo"], p["x"], p["w_in"], p["w_out"]
  dy = x
  m = on_real_rows(topo)
  gmm = lambda transpose: jax.jit(lambda a, b: mosaic.gmm(a, b, topo, transpose, a.dtype))
  pre = gmm(False)(x, w_in)
  h = GELU(pre)
  r = {"gmm_in": timeit(gmm(False), x, w_in),
       "gmm_in+gelu": timeit(jax.jit(lambda a, b: (lambda q: (q, GELU(q)))(mosaic.gmm(a, b, topo, False, a.dtype))),
                             x, w_in)}
  _variant(r, "gmm_act", jax.jit(lambda a, b: mosaic.gmm_act(a, b, topo, GELU)), (x, w_in), h, lambda o: o[1], m)
  for c in GMM_ACT_CONFIGS:
    cf = mosaic.Configs(gmm_act=c, gmm_act_long=c)  # c at every rows-per-expert count
    _variant(r, _tag("gmm_act", c), jax.jit(lambda a, b: mosaic.gmm_act(a, b, topo, GELU, configs=cf)),
             (x, w_in), h, lambda o: o[1], m)
  for c in GMM_CONFIGS:
    cf = mosaic.Configs(gmm=c)
    _variant(r, _tag("gmm_in", c), jax.jit(lambda a, b: mosaic.gmm(a, b, topo, False, a.dtype, configs=cf)),
             (x, w_in), pre, mask=m)
  r["gmm_t"] = timeit(gmm(True), dy, w_out)
  unfused = jax.jit(lambda a, b, q: (mosaic.gmm(a, b, topo, True, a.dtype)
                                     * DERIVATIVES[GELU](q.astype(jnp.float32))).astype(a.dtype))
  r["gmm_t+dgelu"] = timeit(unfused, dy, w_out, pre)
  want = unfused(dy, w_out, pre)
  for c in GMM_DACT_CONFIGS:
    cf = mosaic.Configs(gmm_dact=c)
    _variant(r, _tag("gmm_dact", c), jax.jit(lambda a, b, q: mosaic.gmm_dact(a, b, topo, q, GELU, configs=cf)),
             (dy, w_out, pre), want, mask=m)
  r["check_ok"] = all(v < TOL for k, v in r.items() if k.startswith("err "))
  return r


def run_shapes(shape_results, names, json_name, raw=("err",)):
  """Print shape_results(name) for each shape (seconds as ms, keys starting with `raw` as they
  are) and write them all to results/<json_name>."""
  out = {}
  for name in names:
    out[name] = r = shape_results(name)
    for k, v in r.items():
      print(name, k, f"{v * 1e3:.3f} ms" if isinstance(v, float) and not k.startswith(raw) else v, flush=True)
  with open(os.path.join(HERE, "results", json_name), "w") as fh:
    json.dump(out, fh, indent=1)


if __name__ == "__main__":
  run_shapes(shape_results, sys.argv[1].split(","), "activation_fusion_H100.json")
