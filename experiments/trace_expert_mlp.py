"""Kernel by kernel, the device time of one expert-MLP forward+backward, fused and unfused.

  XLA_FLAGS=--xla_gpu_enable_command_buffer= python experiments/trace_expert_mlp.py E64_top1,E8_top2

(command buffers off, so each kernel carries its HLO op). The loss is sum(y * ct): its cotangent
does not depend on y, so XLA may run dY W_out^T before the forward's activation and merge the
unfused forward and backward activation passes into one; this script shows where it does.
"""
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import profile_step as ps  # noqa: E402
from tune_gmm import problem  # noqa: E402

from sparsejax.kernels import gmm as G  # noqa: E402

for name in sys.argv[1].split(","):
  p = problem(name)
  topo, x, wi, wo = p["topo"], p["x"], p["w_in"], p["w_out"]
  ct = p["x"]  # any [rows, d] cotangent; the problem's rows stand in
  fused = lambda a, b, c: G.expert_mlp(a, b, c, topo, activation=jax.nn.gelu, backend="mosaic")
  unfused = lambda a, b, c: G.gmm(jax.nn.gelu(G.gmm(a, b, topo, backend="mosaic")), c, topo, backend="mosaic")
  for tag, mlp in [("fused", fused), ("unfused", unfused)]:
    step = jax.jit(jax.value_and_grad(lambda a, b, c: jnp.sum((mlp(a, b, c) * ct).astype(jnp.float32)), argnums=(0, 1, 2)))
    for _ in range(3): jax.block_until_ready(step(x, wi, wo))
    d_ = tempfile.mkdtemp()
    with jax.profiler.trace(d_):
      for _ in range(3): jax.block_until_ready(step(x, wi, wo))
    ev = ps.stream_kernels(ps.load_trace(d_))
    n = len(ev) // 3
    last = ev[-n:]
    tot = sum(e["dur"] for e in last)
    print(f"== {name} {tag}: {n} kernels/iter, {tot/1e3:.3f} ms busy, span {(last[-1]['ts']+last[-1]['dur']-last[0]['ts'])/1e3:.3f} ms")
    for e in last:
      print(f"  {e['dur']/1e3:7.3f} ms  {(e.get('args', {}).get('hlo_op') or e['name'])[:70]}")
