"""The GLU epilogues (SwiGLU experts) alone and in the expert MLP, against the unfused composition.

  python experiments/tune_glu_fusion.py E64_top1,E8_top2,E64_top8

Per shape (tune_gmm.py's problems, with a W_gate beside W_in):
- forward: g = x W_gate, u = x W_in (two gmm) then XLA's silu(g) * u, against gmm_glu (one
  kernel, two accumulators per consumer, writing g, u and silu(g) * u);
- backward: dh = dY W_out^T (gmm_t) then XLA's (dh * u * silu'(g), dh * silu(g)), against
  gmm_dglu (g and u loaded by TMA during the K loop);
- the whole expert MLP forward+backward (y and the four gradients, the cotangent released once y
  exists, as in peers/common.jax_case), fused against the same MLP with the activation wrapped so
  that expert_mlp takes the unfused composition of the same Mosaic kernels.
Every fused output is checked against the unfused one on the real rows (err_*, check_ok). The problem's x rows
stand in for dY. Timer: tune_gmm.timeit. Log: experiments/results/glu_fusion_H100.log.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
from tune_activation_fusion import _tag, _variant, on_real_rows, run_shapes  # noqa: E402
from tune_gmm import problem, rel_err, timeit  # noqa: E402

from sparsejax.activations import DERIVATIVES  # noqa: E402
from sparsejax.kernels.gmm import expert_mlp, mosaic  # noqa: E402

SILU = jax.nn.silu
TOL = 1e-2

GLU_CONFIGS = [mosaic.Config(tile_n=128, grid_tile_width=8, epi_slots=3, epi_tile_n=32),
               mosaic.Config(tile_n=128, grid_tile_width=8, epi_slots=3, epi_tile_n=64, max_concurrent_steps=3),
               mosaic.Config(tile_n=128, grid_tile_width=4, epi_slots=3, epi_tile_n=32)]
DGLU_CONFIGS = [mosaic.Config(tile_n=128, epi_tile_n=64, grid_tile_width=8),
                mosaic.Config(tile_n=128, epi_tile_n=32, grid_tile_width=8),
                mosaic.Config(tile_n=64, epi_tile_n=64, max_concurrent_steps=6, grid_tile_width=8)]
# The ping-pong schedule (mosaic_pingpong.gmm_padded; Configs.gmm_glu_short, opt-in for gmm_dglu):
# each consumer's two [128, 64] accumulators, one 6-deep ring (fit_gmm's choice).
_PINGPONG = mosaic.Config(pingpong=True, tile_n=64, max_concurrent_steps=6, epi_tile_n=32,
                          grid_tile_width=8, expert_bands=True)
GLU_CONFIGS.append(_PINGPONG)
DGLU_CONFIGS.append(_PINGPONG)


def shape_results(name):
  p = problem(name)
  topo, x, w_in, w_out = p["topo"], p["x"], p["w_in"], p["w_out"]
  w_gate = (jax.random.normal(jax.random.key(7), w_in.shape, jnp.float32) / p["d"] ** 0.5).astype(w_in.dtype)
  dy = x
  gmm = lambda a, b, transpose=False: mosaic.gmm(a, b, topo, transpose, a.dtype)
  on_real = on_real_rows(topo)

  def unfused_fwd(a, wg, wi):
    g, u = gmm(a, wg), gmm(a, wi)
    return g, u, (SILU(g.astype(jnp.float32)) * u).astype(a.dtype)

  unfused_fwd = jax.jit(unfused_fwd)
  g, u, h = unfused_fwd(x, w_gate, w_in)
  r = {"gmm_in x2": timeit(jax.jit(lambda a, wg, wi: (gmm(a, wg), gmm(a, wi))), x, w_gate, w_in),
       "gmm_in x2+glu": timeit(unfused_fwd, x, w_gate, w_in)}
  for c in GLU_CONFIGS:
    cf = mosaic.Configs(gmm_glu=c, gmm_glu_short=c)  # c at every rows-per-expert count
    _variant(r, _tag("gmm_glu", c), jax.jit(lambda a, wg, wi: mosaic.gmm_glu(a, wg, wi, topo, SILU, configs=cf)),
             (x, w_gate, w_in), h, lambda o: o[2], on_real)

  def unfused_bwd(a, wo, gg, uu):
    dh = gmm(a, wo, True).astype(jnp.float32)
    g32 = gg.astype(jnp.float32)
    return (dh * uu * DERIVATIVES[SILU](g32)).astype(a.dtype), (dh * SILU(g32)).astype(a.dtype)

  unfused_bwd = jax.jit(unfused_bwd)
  r["gmm_t"] = timeit(jax.jit(lambda a, wo: gmm(a, wo, True)), dy, w_out)
  r["gmm_t+dglu"] = timeit(unfused_bwd, dy, w_out, g, u)
  want = unfused_bwd(dy, w_out, g, u)
  for c in DGLU_CONFIGS:
    cf = mosaic.Configs(gmm_dglu=c)
    _variant(r, _tag("gmm_dglu", c),
             jax.jit(lambda a, wo, gg, uu: mosaic.gmm_dglu(a, wo, topo, gg, uu, SILU, configs=cf)),
             (dy, w_out, g, u), want[0], lambda o: o[0], on_real)

  ct = jax.random.normal(jax.random.key(8), (x.shape[0], p["d"]), x.dtype)
  wrapped = lambda v: SILU(v)  # not in mlp.FUSED: expert_mlp composes the unfused kernels

  def mlp_fwdbwd(act):
    def fb(a, wg, wi, wo, c):
      y, vjp = jax.vjp(lambda *w: expert_mlp(w[0], w[2], w[3], topo, activation=act, backend="mosaic",
                                             w_gate=w[1]), a, wg, wi, wo)
      y, c = jax.lax.optimization_barrier((y, c))
      return y, vjp(c)
    return jax.jit(fb)

  args = (x, w_gate, w_in, w_out, ct)
  fused_mlp, unfused_mlp = mlp_fwdbwd(SILU), mlp_fwdbwd(wrapped)
  r["mlp fwd+bwd unfused"] = timeit(unfused_mlp, *args)
  want = unfused_mlp(*args)
  got = fused_mlp(*args)
  r["mlp fwd+bwd fused"] = timeit(fused_mlp, *args)
  for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    r[f"err mlp output {i}"] = rel_err(on_real(a), on_real(b))
  r["mlp useful TFLOP/s fused"] = 18 * p["N"] * p["d"] * p["f"] / r["mlp fwd+bwd fused"] / 1e12
  r["mlp useful TFLOP/s unfused"] = 18 * p["N"] * p["d"] * p["f"] / r["mlp fwd+bwd unfused"] / 1e12
  r["check_ok"] = all(v < TOL for k, v in r.items() if k.startswith("err "))
  return r


if __name__ == "__main__":
  run_shapes(shape_results, sys.argv[1].split(","),
             f"glu_fusion_{jax.devices()[0].device_kind.replace(' ', '_')}.json", raw=("err", "mlp useful"))
