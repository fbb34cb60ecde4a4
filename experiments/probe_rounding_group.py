"""What token rounding over an exchange group costs beyond rounding each device's tokens alone.

Under expert parallelism, `round_to_blocks(routing, axis_name=...)` rounds the tokens of G devices as one
batch: two psums of E counts, an all_gather of each device's 128 least likely assignments and 64 likeliest
candidates per expert, and a sort of those. Here the G devices are simulated on one GPU by `jax.vmap` with
an axis name (the collectives become reshapes), so this times the added kernels, not the network:

  alone   vmap(round_to_blocks): each shard rounded by itself
  group   vmap(round_to_blocks(axis_name="g")): the shards rounded as one batch
  routing vmap(top_k_routing): the router's top-k, for scale

The vmapped program does G devices' work at once, so `group - alone` bounds from above what one device adds.
Every group result is checked equal to round_to_blocks on the G shards concatenated, and every alone result
to round_to_blocks on each shard. One process, one timer (peers.common.Timer), random routings.

  python experiments/probe_rounding_group.py [--shapes E64_top1,E64_top8] [--groups 1,4,8]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sparsejax as sj  # noqa: E402

from peers import common  # noqa: E402
from bench_moe_layer import SHAPES, SMOKE_SHAPES  # noqa: E402


def shard_logits(shape, groups: int, seed: int = 0):
  """[G, T, E] float32 router logits: random; skewed shapes favour expert i by (i + 1)^-0.5, as the bench's."""
  logits = jax.random.normal(jax.random.key(seed), (groups, shape.T, shape.E), jnp.float32)
  if shape.skewed:
    logits = logits - 0.5 * jnp.log1p(jnp.arange(shape.E, dtype=jnp.float32))
  return logits


def variants(k: int):
  route = lambda lg: sj.top_k_routing(lg, k)
  return {
      "routing": jax.jit(jax.vmap(lambda lg: route(lg).expert_ids)),
      "alone": jax.jit(jax.vmap(lambda lg: sj.round_to_blocks(route(lg)).expert_ids)),
      "group": jax.jit(jax.vmap(lambda lg: sj.round_to_blocks(route(lg), axis_name="g").expert_ids,
                                axis_name="g")),
  }


def check(name, got, logits, k) -> bool:
  groups, tokens, _ = logits.shape
  if name == "group":
    want = sj.round_to_blocks(sj.top_k_routing(logits.reshape(groups * tokens, -1), k)).expert_ids
    return bool(np.array_equal(np.asarray(got).reshape(groups * tokens, -1), want))
  if name == "alone":
    return all(np.array_equal(got[g], sj.round_to_blocks(sj.top_k_routing(logits[g], k)).expert_ids)
               for g in range(groups))
  return True


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default=None, help="comma-separated names (default: E64_top1,E64_top1_skewed,E64_top8; "
                  "with --smoke, both smoke shapes)")
  ap.add_argument("--groups", default="1,4,8")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes and a one-shot timer (any machine)")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args(argv)
  default = ",".join(s.name for s in SMOKE_SHAPES) if args.smoke else "E64_top1,E64_top1_skewed,E64_top8"
  names = args.shapes or default
  shapes = [s for s in (SMOKE_SHAPES if args.smoke else SHAPES) if s.name in names.split(",")]
  if not shapes:
    raise SystemExit(f"--shapes {names!r}: no such shape.")
  timer = common.SMOKE_TIMER if args.smoke else common.Timer()
  records = []
  for s in shapes:
    for g in (int(v) for v in args.groups.split(",")):
      logits = shard_logits(s, g)
      times = {}
      for name, fn in variants(s.k).items():
        ok = check(name, fn(logits), logits, s.k)
        t = timer(lambda fn=fn: fn(logits), jax.block_until_ready)
        times[name] = t["median_s"] * 1e3
        records.append(dict(shape=s.name, groups=g, tokens_per_device=s.T, experts=s.E, k=s.k,
                            variant=name, median_ms=times[name], check_ok=ok, timing=t))
        print(f"{s.name:16s} G={g:<2d} {name:8s} {times[name]:8.3f} ms{'' if ok else '  CHECK FAILED'}", flush=True)
      print(f"{s.name:16s} G={g:<2d} group - alone {times['group'] - times['alone']:+.3f} ms for {g} devices' "
            f"tokens ({s.T} each)", flush=True)
  dev = jax.devices()[0].device_kind.replace(" ", "_")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"rounding_group_probe_{dev}.json"), "w") as fh:
    json.dump(dict(device=dev, jax=jax.__version__, records=records), fh, indent=1)
  return records


if __name__ == "__main__":
  main()
