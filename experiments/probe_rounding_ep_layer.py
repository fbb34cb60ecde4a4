"""The expert-parallel rounded layer: token rounding's group path by the Pallas kernels against the sorts, and
against the dropless layer, in the layer a training step runs.

A mesh of --gpus devices (1 x N: one exchange group) runs every step of `rounded_moe_mlp(mesh=...)`: the group's
psums and all_gather, its rounding (kernels.block_rounding with axis_name), the exchange and the products; each
device holds T tokens of the shape and E/N experts, inputs placed as the layer shards them. Variants, forward and
backward of sum(y * ct) with respect to x, the router logits and both weights:

  ep_kernel       the rounded layer, the group's moves by the kernels (impl "auto" on a GPU)
  ep_sort         the same layer with the moves by the reference's sorts (block_rounding.op.runs_kernel held False)
  ep_dropless     expert_parallel_moe_mlp on the router's top-k: what rounding is meant to beat
  single          sj.rounded_moe_mlp without a mesh on one device, all N T tokens: the reference of the rounded
                  variants (one group rounds as the joined tokens), and for scale
  single_dropless sj.moe_mlp on one device, all N T tokens: the reference of ep_dropless

Each variant's dropped count and its values and four gradients are checked against its reference's (bf16: a float32
weight one ulp apart may flip an output's last bit, so the tolerance is bf16's). The variants are timed in --rounds
interleaved rounds (peers.common.Timer); each figure is the median over rounds.

  python experiments/probe_rounding_ep_layer.py [--gpus 2] [--shapes E64_top1,E8_top6] [--rounds 3] [--smoke]
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
from sparsejax import mesh as meshlib, parallel  # noqa: E402
from sparsejax.kernels.block_rounding import op  # noqa: E402

from peers import common  # noqa: E402

# (name, T a device, d, f, E, k): bench_moe_layer's E64 top-1 and top-8 shapes, and one with fewer experts a device
# than k on 2 devices (E/P < k, where the exchange's default buffer is below the worst case).
SHAPES = [("E64_top1", 16384, 1024, 4096, 64, 1), ("E64_top8", 8192, 2048, 1024, 64, 8),
          ("E8_top6", 8192, 2048, 1024, 8, 6)]
DEFAULT_SHAPES = "E64_top1,E64_top8"
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


def step(k, rounded, mesh_or_none):
  def loss(x, logits, w_in, w_out, ct):
    routing = sj.top_k_routing(logits, k)
    if rounded:
      y, stats = sj.rounded_moe_mlp(x, routing, w_in, w_out, mesh=mesh_or_none)
    elif mesh_or_none is None:
      y, stats = sj.moe_mlp(x, routing.expert_ids, routing.combine_weights.astype(x.dtype), w_in, w_out)
    else:
      y, stats = parallel.expert_parallel_moe_mlp(x, routing.expert_ids, routing.combine_weights.astype(x.dtype),
                                                  w_in, w_out, mesh=mesh_or_none)
    return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), (y, stats.num_dropped)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def variants(k, mesh):
  """name: (step, context to trace it under, whether its operands lie on the mesh, its reference's name)."""
  return {"ep_kernel": (step(k, True, mesh), contextlib.nullcontext, True, "single"),
          "ep_sort": (step(k, True, mesh), moves_by_sort, True, "single"),
          "ep_dropless": (step(k, False, mesh), contextlib.nullcontext, True, "single_dropless"),
          "single": (step(k, True, None), contextlib.nullcontext, False, "single"),
          "single_dropless": (step(k, False, None), contextlib.nullcontext, False, "single_dropless")}


def check(out, want) -> tuple[bool, list[float]]:
  """Host-side compare: the outputs may lie on different devices."""
  (_, (y, dropped)), grads = out
  (_, (y0, dropped0)), grads0 = want
  errs = []
  for a, b in zip((y, *grads), (y0, *grads0)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    errs.append(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30)))
  return int(dropped) == int(dropped0) and max(errs) < TOLERANCE, errs


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--gpus", type=int, default=1, help="devices of the 1 x N mesh; T tokens a device")
  ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma list of {[s[0] for s in SHAPES]}")
  ap.add_argument("--variants", default="", help="comma list (default all); their references run too")
  ap.add_argument("--tag", default="", help="appended to the JSON's name")
  ap.add_argument("--smoke", action="store_true", help="a tiny shape and a one-shot timer (any machine)")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args(argv)
  timer = common.SMOKE_TIMER if args.smoke else common.Timer()
  n = args.gpus
  if n > len(jax.devices()):
    raise SystemExit(f"--gpus {n}: only {len(jax.devices())} devices are visible.")
  mesh = meshlib.make_expert_mesh(1, n, devices=jax.devices()[:n])
  wanted = args.shapes.split(",")
  unknown = sorted(set(wanted) - {s[0] for s in SHAPES})
  if unknown and not args.smoke:
    raise SystemExit(f"--shapes: unknown {unknown}; choose from {[s[0] for s in SHAPES]}.")
  records = []
  for name, T, d, f, E, k in SMOKE_SHAPES if args.smoke else [s for s in SHAPES if s[0] in wanted]:
    if E % n:
      raise SystemExit(f"{name}: {E} experts do not split over {n} devices.")
    layout = meshlib.expert_layout(mesh, E)
    tok = layout.sharding(layout.tokens)
    one = jax.devices()[0]
    host = problem(n * T, d, f, E)
    placed = {True: jax.device_put(host, (tok, tok, layout.sharding(layout.w_in()), layout.sharding(layout.w_out()),
                                          tok)),
              False: jax.device_put(host, one)}
    runs = variants(k, mesh)
    if args.variants:
      picked = set(args.variants.split(","))
      if picked - set(runs):
        raise SystemExit(f"--variants: unknown {sorted(picked - set(runs))}; choose from {list(runs)}.")
      runs = {v: r for v, r in runs.items() if v in picked or any(runs[p][3] == v for p in picked)}
    outs = {}
    for v, (fn, during, on_mesh, _) in runs.items():
      with during():  # trace and compile under the variant's choice
        outs[v] = fn(*placed[on_mesh])
    times = {v: [] for v in runs}
    for r in range(args.rounds):
      for v in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
        fn, _, on_mesh, _ = runs[v]
        times[v].append(timer(lambda fn=fn, a=placed[on_mesh]: fn(*a), jax.block_until_ready)["median_s"] * 1e3)
    for v, (_, _, on_mesh, ref) in runs.items():
      ok, errs = check(outs[v], outs[ref])
      ms = statistics.median(times[v])
      records.append(dict(shape=name, gpus=n, tokens_per_device=T, tokens=n * T, devices_used=n if on_mesh else 1,
                          d=d, f=f, experts=E, k=k, variant=v, reference=ref, fwdbwd_ms=ms, rounds=times[v],
                          num_dropped=int(outs[v][0][1][1]), rel_err_vs_reference=errs, check_ok=ok))
      print(f"{name:9s} {v:15s} {n if on_mesh else 1} dev, {n * T} tok  fwd+bwd {ms:7.3f} ms (rounds "
            + " ".join(f"{t:.3f}" for t in times[v]) + f")  dropped {int(outs[v][0][1][1])}  "
            f"rel err vs {ref} y, dx, dlogits, dw_in, dw_out " + " ".join(f"{e:.1e}" for e in errs)
            + ("" if ok else "  CHECK FAILED"), flush=True)
  dev = jax.devices()[0].device_kind.replace(" ", "_")
  os.makedirs(args.out, exist_ok=True)
  stem = f"rounding_ep_layer_probe_{dev}_x{n}{args.tag}{'_smoke' if args.smoke else ''}"
  with open(os.path.join(args.out, stem + ".json"), "w") as fh:
    json.dump(dict(device=dev, jax=jax.__version__, gpus=n, records=records), fh, indent=1)
  return records


if __name__ == "__main__":
  main()
