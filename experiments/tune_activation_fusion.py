"""The activation epilogues alone, against a gmm and a separate XLA pass, and their config sweep.

  python experiments/tune_activation_fusion.py E64_top1,E8_top2,E64_top8

Per shape (the issue's, placed as moe_mlp places them): x W_in then gelu (gmm_in+gelu) against
gmm_act (one kernel writing pre and gelu(pre)), and dY W_out^T times gelu'(pre) (gmm_t+dgelu)
against gmm_dact, each over a few Mosaic configs, every fused output checked against the
unfused one. Timer: tune_gmm.timeit. The defaults in sparsejax/kernels/gmm/mosaic.py came from
this sweep (log: experiments/results/activation_fusion_H100.log).
"""
import sys, os, dataclasses, json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax, jax.numpy as jnp, numpy as np
from tune_gmm import timeit, rel_err
from sparsejax import permute
from sparsejax.activations import DERIVATIVES
from sparsejax.kernels.gmm import mosaic
from sparsejax.topology import make_topology
gelu = jax.nn.gelu; dgelu = DERIVATIVES[gelu]
SH = {"E64_top1": (16384, 1024, 4096, 64, 1), "E8_top2": (16384, 2048, 8192, 8, 2), "E64_top8": (8192, 2048, 1024, 64, 8)}


def expert_problem(name):
  """(topology, x rows, W_in, W_out, dY) of a shape, placed as moe_mlp places them; bf16."""
  T, d, f, E, k = SH[name]
  ks = jax.random.split(jax.random.key(0), 6)
  ids = jax.lax.top_k(jax.random.gumbel(ks[0], (T, E)), k)[1].astype(jnp.int32)
  plc = permute.dropless_placement(ids, E, block_size=128)
  topo = make_topology(plc.group_sizes, plc.num_rows, 128, plc.tokens_per_expert)
  R = plc.num_rows
  x = jax.random.normal(ks[1], (R, d), jnp.bfloat16)
  wi = (jax.random.normal(ks[2], (E, d, f)) / d**.5).astype(jnp.bfloat16)
  wo = (jax.random.normal(ks[3], (E, f, d)) / f**.5).astype(jnp.bfloat16)
  dy = jax.random.normal(ks[4], (R, d), jnp.bfloat16)
  return topo, x, wi, wo, dy


def main(names):
  out = {}
  for name in names:
    topo, x, wi, wo, dy = expert_problem(name)
    pre = jax.jit(lambda a, b: mosaic.gmm(a, b, topo, False, jnp.bfloat16))(x, wi)
    r = {}
    r["gmm_in"] = timeit(jax.jit(lambda a, b: mosaic.gmm(a, b, topo, False, jnp.bfloat16)), x, wi)
    r["gmm_in+gelu"] = timeit(jax.jit(lambda a, b: (lambda p: (p, gelu(p)))(mosaic.gmm(a, b, topo, False, jnp.bfloat16))), x, wi)
    act = jax.jit(lambda a, b: mosaic.gmm_act(a, b, topo, gelu))
    r["gmm_act"] = timeit(act, x, wi)
    p2, h2 = act(x, wi)
    r["err_act"] = rel_err(h2, gelu(pre))
    for cfg in [mosaic.Config(grid_tile_width=8, epi_slots=4, epi_tile_n=32), mosaic.Config(grid_tile_width=8, epi_slots=4, epi_tile_n=64),
                mosaic.Config(grid_tile_width=8, epi_slots=3, epi_tile_n=64, max_concurrent_steps=3)]:
      cf = mosaic.Configs(gmm_act=cfg)
      tag = f"gmm_act s{cfg.max_concurrent_steps} e{cfg.epi_tile_n} slots{cfg.epi_slots}"
      try:
        fn = jax.jit(lambda a, b: mosaic.gmm_act(a, b, topo, gelu, configs=cf))
        got = fn(x, wi)
        r[tag] = timeit(fn, x, wi); r["err " + tag] = rel_err(got[1], h2)
      except Exception as e:
        r[tag] = f"FAILED {type(e).__name__}: {str(e)[:200]}"
    for cfg in [mosaic.Config(epi_slots=4, epi_tile_n=32), mosaic.Config(epi_slots=4, epi_tile_n=64)]:
      cf = mosaic.Configs(gmm=cfg)
      tag = f"gmm_in s{cfg.max_concurrent_steps} e{cfg.epi_tile_n} slots{cfg.epi_slots} w{cfg.grid_tile_width}"
      fn = jax.jit(lambda a, b: mosaic.gmm(a, b, topo, False, jnp.bfloat16, configs=cf))
      r[tag] = timeit(fn, x, wi)
    r["gmm_t"] = timeit(jax.jit(lambda a, b: mosaic.gmm(a, b, topo, True, jnp.bfloat16)), dy, wo)
    unf = jax.jit(lambda a, b, p: (mosaic.gmm(a, b, topo, True, jnp.bfloat16) * dgelu(p.astype(jnp.float32))).astype(jnp.bfloat16))
    r["gmm_t+dgelu"] = timeit(unf, dy, wo, pre)
    want = unf(dy, wo, pre)
    for cfg in [mosaic.Config(max_concurrent_steps=3, epi_tile_n=32), mosaic.Config(max_concurrent_steps=3, epi_tile_n=32, epi_slots=3),
                mosaic.Config(tile_n=128, max_concurrent_steps=5, epi_tile_n=64, grid_tile_width=8)]:
      cf = mosaic.Configs(gmm_dact=cfg)
      tag = f"gmm_dact n{cfg.tile_n} k{cfg.tile_k} s{cfg.max_concurrent_steps} e{cfg.epi_tile_n} w{cfg.grid_tile_width}"
      try:
        fn = jax.jit(lambda a, b, p: mosaic.gmm_dact(a, b, topo, p, gelu, configs=cf))
        got = fn(dy, wo, pre)
        r[tag] = timeit(fn, dy, wo, pre); r["err " + tag] = rel_err(got, want)
      except Exception as e:
        r[tag] = f"FAILED {type(e).__name__}: {str(e)[:200]}"
    for kk, v in r.items():
      print(name, kk, f"{v*1e3:.3f} ms" if isinstance(v, float) and not kk.startswith("err") else v, flush=True)
    out[name] = r
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "activation_fusion_H100.json")
  with open(path, "w") as fh:
    json.dump(out, fh, indent=1)


if __name__ == "__main__":
  main(sys.argv[1].split(","))
