"""Config sets of the Mosaic kernels A/B'd on the fused expert MLP and the whole dropless layer,
forward+backward, each run back to back as in training.

At the card's power cap a kernel that runs faster alone may not make the program faster: it can
draw the power that the other kernels' clock then loses (notes_hopper_kernels.md, twentieth
session). bench_expert_mlp_parts.py --ab-rounds times each kernel in windows of ten calls, where
the clock has not settled; this times the MLP (bench_expert_mlp_parts' problem) and the layer
(bench_moe_layer's shapes, routing and loss) for --seconds of back-to-back calls a window, the
config sets alternating and their order reversed every second round, and prints each case's
median ms a call over --rounds rounds. Each set's outputs are first compared with the first set's:
the layer's outputs and the MLP's weight gradients exactly, y and dx on the real rows (other rows
may be left unwritten). Needs an sm_90 GPU:
  python experiments/ab_sustained.py --shapes E64_top1_skewed,E64_top1 --configs default,default_again
"""
import argparse
import os
import statistics
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench_expert_mlp_parts as parts  # noqa: E402
from bench_moe_layer import SHAPES as LAYER_SHAPES  # noqa: E402
from peers import layer  # noqa: E402
from peers.common import fwd_bwd  # noqa: E402
from provenance import source_fingerprint  # noqa: E402
from sparsejax.kernels.gmm.mlp import expert_mlp  # noqa: E402


def sustained_ms(fn, args, seconds: float) -> float:
  """ms a call of fn(*args) run back to back for `seconds` (synced every ten calls), after 3 warm-up calls."""
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  t0, n = time.perf_counter(), 0
  while time.perf_counter() - t0 < seconds:
    for _ in range(10):
      out = fn(*args)
    jax.block_until_ready(out)
    n += 10
  return (time.perf_counter() - t0) / n * 1e3


def cases(shape: str, config_sets, what) -> tuple[dict, jax.Array]:
  """{(mlp|layer, set): (compiled fwd+bwd, args)} and the MLP's real-row mask."""
  out, real = {}, None
  if "mlp" in what:
    p = parts.problem(shape)
    topo = p["topo"]
    real = parts.real_rows(topo)[:, None]
    dy = jnp.where(real, jax.random.normal(jax.random.key(9), (p["x"].shape[0], p["d"]), p["x"].dtype), 0)
    args = (p["x"], p["w_in"], p["w_out"])
    for c in config_sets:
      with parts.config_set(c):  # a fresh function per set: jit caches traces by function identity
        fn = fwd_bwd(lambda x, wi, wo: expert_mlp(x, wi, wo, topo, activation=jax.nn.gelu, backend="mosaic"), dy)
        out["mlp", c] = (jax.jit(fn).lower(*args).compile(), args)
  if "layer" in what:
    s = next(x for x in LAYER_SHAPES if x.name == shape)
    a = layer.inputs(s)
    args = (a["x"], a["bias"], a["w_r"], a["w_in"], a["w_out"], a["ct"])
    for c in config_sets:
      with parts.config_set(c):
        out["layer", c] = (layer.functions(s, "auto", None)[2].lower(*args).compile(), args)
  return out, real


def max_diffs(got, want, real) -> list[float]:
  """Max |got - want| per output leaf; the MLP's y and dx (rows-long) on the real rows only."""
  diffs = []
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    g, w = g.astype(jnp.float32), w.astype(jnp.float32)
    if real is not None and i < 2:
      g, w = jnp.where(real, g, 0), jnp.where(real, w, 0)
    diffs.append(float(jnp.max(jnp.abs(g - w))))
  return diffs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="E64_top1_skewed,E64_top1", help="names both benches know")
  ap.add_argument("--configs", default="default,default_again", help=f"of {', '.join(parts.CONFIG_SETS)}")
  ap.add_argument("--what", default="mlp,layer")
  ap.add_argument("--rounds", type=int, default=6)
  ap.add_argument("--seconds", type=float, default=1.5)
  args = ap.parse_args(argv)
  config_sets = args.configs.split(",")
  if len(config_sets) < 2 or any(c not in parts.CONFIG_SETS for c in config_sets):
    ap.error(f"--configs: two or more of {', '.join(parts.CONFIG_SETS)}")
  what = args.what.split(",")
  if not set(what) <= {"mlp", "layer"}:
    ap.error("--what: mlp, layer or both")
  if jax.default_backend() != "gpu":
    ap.error("needs a GPU (the Mosaic kernels compiled, at the card's power cap)")
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; sparsejax source {source_fingerprint()}",
        flush=True)
  for shape in args.shapes.split(","):
    compiled, real = cases(shape, config_sets, what)
    outs = {k: jax.block_until_ready(f(*a)) for k, (f, a) in compiled.items()}
    for kind, c in compiled:
      if c != config_sets[0]:
        d = max_diffs(outs[kind, c], outs[kind, config_sets[0]], real if kind == "mlp" else None)
        print(f"{shape} {kind} {c} against {config_sets[0]}: max abs diff per output "
              f"{', '.join(f'{x:.1e}' for x in d)}", flush=True)
    ms = {k: [] for k in compiled}
    for r in range(args.rounds):
      for k in (list(compiled) if r % 2 == 0 else list(reversed(list(compiled)))):
        ms[k].append(sustained_ms(*compiled[k], args.seconds))
    for (kind, c), v in ms.items():
      print(f"{shape} {kind:5s} {c:20s} median {statistics.median(v):.4f} ms a call; rounds "
            + " ".join(f"{x:.4f}" for x in v), flush=True)


if __name__ == "__main__":
  main()
