"""Which half of tgmm's tile order pays: the experts sorted heaviest first, the reversed waves, or both.

Times tgmm at MoE-XS's layer shape (bench_gmm_skew's problems) in four orders: expert order
(Config.balance_experts=False), sorted + reversed waves (the default), sorted only and reversed
waves only (the last two by swapping mosaic.heaviest_first / mosaic._tgmm_item for the identity
before tracing), three rounds alternating the variants, and checks all four give bit-identical
gradients (each tile's reduction is the same; only which SM runs it changes). GPU only.

  python experiments/probe_tgmm_order.py 0,0.5,1,2     # sigmas of the routing bias
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsejax.kernels.gmm import mosaic
from bench_gmm_skew import skewed_problem, XS_B128
from tune_gmm import timeit

base = mosaic.DEFAULT_CONFIGS
off = base.with_tgmm(balance_experts=False)
ident_order = lambda offsets: jnp.arange(offsets.shape[0] - 1, dtype=jnp.int32)
no_snake = lambda step, total, width: step
real_hf, real_item = mosaic.heaviest_first, mosaic._tgmm_item

def build(name, topo):
  mosaic.heaviest_first, mosaic._tgmm_item = real_hf, real_item
  cfg = base
  if name == "expert": cfg = off
  if name == "snake only": mosaic.heaviest_first = ident_order
  if name == "sorted only": mosaic._tgmm_item = no_snake
  f = jax.jit(lambda a, b: mosaic.tgmm(a, b, topo, a.dtype, cfg))
  return f

for sigma in map(float, sys.argv[1].split(",")):
  p = skewed_problem(XS_B128, sigma)
  topo, x, h = p["topo"], p["x"], p["h"]
  blocks = np.diff(np.asarray(topo.expert_block_offsets))
  names = ["expert", "sorted+snake", "sorted only", "snake only"]
  fns = {}
  for n in names:
    fns[n] = build(n, topo)
    fns[n].lower(x, h).compile()
    jax.block_until_ready(fns[n](x, h))
  mosaic.heaviest_first, mosaic._tgmm_item = real_hf, real_item
  ref = fns["expert"](x, h)
  res = {n: [] for n in names}
  for r in range(3):
    for n in names:
      res[n].append(1e3 * timeit(fns[n], x, h))
  same = {n: bool(jnp.all(fns[n](x, h) == ref)) for n in names}
  print(f"sigma {sigma}: blocks/expert min {blocks.min()} max {blocks.max()} | " +
        " | ".join(f"{n} {np.round(v, 3).tolist()}{'' if same[n] else ' DIFFERS'}" for n, v in res.items()), flush=True)
