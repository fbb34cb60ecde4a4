"""The expert-parallel rounded layer on a one-device mesh: token rounding's group path by the Pallas kernels against
the sorts, in the layer a training step runs.

A mesh of one device runs every step of `rounded_moe_mlp(mesh=...)`: the group's psums and all_gather (of one
device), its rounding (kernels.block_rounding with axis_name), the exchange and the products. Variants, forward and
backward of sum(y * ct) with respect to x, the router logits and both weights:

  ep_kernel  the group's moves by the kernels (impl "auto" on a GPU)
  ep_sort    the same layer with the moves by the reference's sorts (block_rounding.op.runs_kernel held False)
  single     sj.rounded_moe_mlp without a mesh: the single-device layer, for scale

Each variant's dropped count and its values and four gradients are checked against single's (bf16: a float32
weight one ulp apart may flip an output's last bit, so the tolerance is bf16's). The variants are timed in --rounds
interleaved rounds (peers.common.Timer); each figure is the median over rounds.

  python experiments/probe_rounding_ep_layer.py [--rounds 3] [--smoke]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sparsejax as sj  # noqa: E402
from sparsejax import mesh as meshlib  # noqa: E402
from sparsejax.kernels.block_rounding import op  # noqa: E402

from peers import common  # noqa: E402

# (name, T, d, f, E, k): bench_moe_layer's E64 top-1 and top-8 shapes.
SHAPES = [("E64_top1", 16384, 1024, 4096, 64, 1), ("E64_top8", 8192, 2048, 1024, 64, 8)]
SMOKE_SHAPES = [("smoke", 1024, 32, 64, 4, 1)]
TOLERANCE = 2e-2  # bf16, relative to each output's largest entry


@contextlib.contextmanager
def moves_by_sort():
  """Rounding's moves by the reference's sorts while tracing inside."""
  real = op.runs_kernel
  op.runs_kernel = lambda impl="auto": False
  try:
    yield
  finally:
    op.runs_kernel = real


def problem(T, d, f, E, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  bf = lambda key, shape, scale=1.0: (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)
  return (bf(keys[0], (T, d)), jax.random.normal(keys[1], (T, E), jnp.float32), bf(keys[2], (E, d, f), d ** -0.5),
          bf(keys[3], (E, f, d), f ** -0.5), bf(keys[4], (T, d)))


def variants(k, ct, mesh):
  def step(mesh_or_none):
    def loss(x, logits, w_in, w_out):
      y, stats = sj.rounded_moe_mlp(x, sj.top_k_routing(logits, k), w_in, w_out, mesh=mesh_or_none)
      return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), (y, stats.num_dropped)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  return {"ep_kernel": (step(mesh), contextlib.nullcontext), "ep_sort": (step(mesh), moves_by_sort),
          "single": (step(None), contextlib.nullcontext)}


def check(out, want) -> tuple[bool, list[float]]:
  (_, (y, dropped)), grads = out
  (_, (y0, dropped0)), grads0 = want
  errs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                jnp.maximum(jnp.max(jnp.abs(b.astype(jnp.float32))), 1e-30)) for a, b in zip((y, *grads), (y0, *grads0))]
  return int(dropped) == int(dropped0) and max(errs) < TOLERANCE, errs


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--smoke", action="store_true", help="a tiny shape and a one-shot timer (any machine)")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args(argv)
  timer = common.SMOKE_TIMER if args.smoke else common.Timer()
  mesh = meshlib.make_expert_mesh(1, 1)
  records = []
  for name, T, d, f, E, k in SMOKE_SHAPES if args.smoke else SHAPES:
    *operands, ct = problem(T, d, f, E)
    runs = variants(k, ct, mesh)
    outs = {}
    for v, (fn, during) in runs.items():
      with during():  # trace and compile under the variant's choice
        outs[v] = fn(*operands)
    times = {v: [] for v in runs}
    for r in range(args.rounds):
      for v in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
        times[v].append(timer(lambda fn=runs[v][0]: fn(*operands), jax.block_until_ready)["median_s"] * 1e3)
    for v in runs:
      ok, errs = check(outs[v], outs["single"])
      ms = statistics.median(times[v])
      records.append(dict(shape=name, tokens=T, d=d, f=f, experts=E, k=k, variant=v, fwdbwd_ms=ms, rounds=times[v],
                          num_dropped=int(outs[v][0][1][1]), rel_err_vs_single=errs, check_ok=ok))
      print(f"{name:9s} {v:10s} fwd+bwd {ms:7.3f} ms (rounds " + " ".join(f"{t:.3f}" for t in times[v]) + ")  "
            f"dropped {int(outs[v][0][1][1])}  rel err y, dx, dlogits, dw_in, dw_out "
            + " ".join(f"{e:.1e}" for e in errs) + ("" if ok else "  CHECK FAILED"), flush=True)
  dev = jax.devices()[0].device_kind.replace(" ", "_")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"rounding_ep_layer_probe_{dev}{'_smoke' if args.smoke else ''}.json"), "w") as fh:
    json.dump(dict(device=dev, jax=jax.__version__, records=records), fh, indent=1)
  return records


if __name__ == "__main__":
  main()
