"""What token rounding over an exchange group costs beyond rounding each device's tokens alone.

Under expert parallelism, `round_to_blocks(routing, axis_name=...)` rounds the tokens of G devices as one
batch: two psums of E counts, an all_gather of each device's 128 least likely assignments and 64 likeliest
candidates per expert, and a sort of those. Here the G devices are simulated on one GPU by `jax.vmap` with
an axis name (the collectives become reshapes), so this times the added kernels, not the network:

  alone         vmap(round_to_blocks(impl="xla")): each shard rounded by itself, its items ranked by one sort
  group         vmap(round_to_blocks(axis_name="g", impl="xla")): the shards rounded as one batch, by sorts
  alone_kernel  the same as alone by the Pallas kernel (impl="triton"; interpreted off the GPU)
  group_kernel  the same as group by the Pallas kernels (fifty-sixth session)
  routing       vmap(top_k_routing): the router's top-k, for scale

The vmapped program does G devices' work at once, so `group - alone` bounds from above what one device adds.
On a real device only the group's second stage grows with G: it picks each expert's n-th among the b items every
device sent. That stage is timed alone at one device's width (G b a row; random items, checked against a sort;
16 problems a call, the time per problem):

  nth_kernel    kernels.block_rounding.triton.nth_thresholds on [E, G b]
  nth_sort      the reference's two sorts, [E, G b] and [E, G b / 2], and the n-th taken

and "one device" estimates a device's rounding in a group of G as group(G = 1) + nth(G) - nth(1).
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
  out = {"routing": jax.jit(jax.vmap(lambda lg: route(lg).expert_ids))}
  for suffix, impl in (("", "xla"), ("_kernel", "triton")):
    out["alone" + suffix] = jax.jit(jax.vmap(lambda lg, impl=impl: sj.round_to_blocks(route(lg), impl=impl).expert_ids))
    out["group" + suffix] = jax.jit(jax.vmap(
        lambda lg, impl=impl: sj.round_to_blocks(route(lg), axis_name="g", impl=impl).expert_ids, axis_name="g"))
  return out


# Jitted, one compile a shape: op by op, each of the sort's many small ops compiled on its own.
_by_the_sort = jax.jit(lambda lg, k: sj.round_to_blocks(sj.top_k_routing(lg, k), impl="xla").expert_ids,
                       static_argnums=1)


def check(name, got, logits, k) -> bool:
  """Every rounding against round_to_blocks by the sort: on the joined shards (group), or on each (alone)."""
  groups, tokens, _ = logits.shape
  if name.startswith("group"):
    want = _by_the_sort(logits.reshape(groups * tokens, -1), k)
    return bool(np.array_equal(np.asarray(got).reshape(groups * tokens, -1), want))
  if name.startswith("alone"):
    return all(np.array_equal(got[g], _by_the_sort(logits[g], k)) for g in range(groups))
  return True


REPEATS = 16  # second-stage problems per timed call


def second_stage(E: int, G: int, T: int, b: int = 128, seed: int = 0, repeats: int = REPEATS):
  """{name: (fn, args)} of the group's n-th at one device's width, each fn `repeats` independent problems in one
  jit (a lone call of a few microseconds would time the host's dispatch); and whether the kernel's (v, i) is the
  sort's on all of them."""
  from jax.experimental import pallas as pl
  from sparsejax.kernels.block_rounding import triton
  sent = G * min(T, b)  # each device sends up to b items of an expert
  width = pl.next_power_of_2(sent)
  keys = jax.random.split(jax.random.key(seed), 3)
  u = jax.random.randint(keys[0], (repeats, E, width), 0, 1 << 20, jnp.int32)  # score ties happen
  perms = jax.vmap(lambda k: jax.random.permutation(k, G * T)[:sent])(jax.random.split(keys[1], repeats * E))
  tt = jnp.pad(perms.reshape(repeats, E, sent), ((0, 0), (0, 0), (0, width - sent)), constant_values=-1)
  n = jax.random.randint(keys[2], (repeats, E), 1, min(b, sent), jnp.int32)
  each = lambda f: lambda u, tt, n: [f(u[r], tt[r], n[r]) for r in range(repeats)]
  kernel = jax.jit(each(lambda u, tt, n: triton.nth_thresholds(u, tt, n, G * T - 1,
                                                               interpret=jax.default_backend() != "gpu")))

  def nth_by_sort(u, tt, n):  # order: u ascending, ties to the larger tt; the non-members last
    member = tt >= 0
    su, sneg = jax.lax.sort((jnp.where(member, u, jnp.iinfo(jnp.int32).max), jnp.where(member, -tt, 1)),
                            dimension=1, num_keys=2)
    take = lambda a: jnp.take_along_axis(a, (n - 1)[:, None], axis=1)[:, 0]
    return take(su), -take(sneg)

  def sorts(u, tt, n):  # the reference's drop-side and add-side sorts at this width
    half = sent // 2
    return nth_by_sort(u[:, :sent], tt[:, :sent], n), nth_by_sort(u[:, :half], tt[:, :half], jnp.minimum(n, half))

  got, want = kernel(u, tt, n), jax.jit(each(nth_by_sort))(u, tt, n)
  ok = all(np.array_equal(g, w) for gw, ww in zip(got, want) for g, w in zip(gw, ww))
  return {"nth_kernel": (kernel, (u, tt, n)), "nth_sort": (jax.jit(each(sorts)), (u, tt, n))}, ok


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
  records, at_one = [], {}  # at_one: a shape's times at G = 1, the estimates' base
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
        print(f"{s.name:16s} G={g:<2d} {name:12s} {times[name]:8.3f} ms{'' if ok else '  CHECK FAILED'}", flush=True)
      for suffix in ("", "_kernel"):
        print(f"{s.name:16s} G={g:<2d} group{suffix} - alone{suffix} "
              f"{times['group' + suffix] - times['alone' + suffix]:+.3f} ms for {g} devices' tokens ({s.T} each)",
              flush=True)
      repeats = 2 if args.smoke else REPEATS
      stage, ok = second_stage(s.E, g, s.T, repeats=repeats)
      for name, (fn, fn_args) in stage.items():
        t = timer(lambda fn=fn, fn_args=fn_args: fn(*fn_args), jax.block_until_ready)
        times[name] = t["median_s"] * 1e3 / repeats
        records.append(dict(shape=s.name, groups=g, tokens_per_device=s.T, experts=s.E, k=s.k,
                            variant=name, median_ms=times[name], check_ok=ok, timing=t))
        print(f"{s.name:16s} G={g:<2d} {name:12s} {times[name]:8.3f} ms{'' if ok else '  CHECK FAILED'}", flush=True)
      if g == 1:
        at_one[s.name] = times
      base = at_one.get(s.name)
      if base is not None:
        for suffix, stage_name in (("_kernel", "nth_kernel"), ("", "nth_sort")):
          est = base["group" + suffix] + times[stage_name] - base[stage_name]
          records.append(dict(shape=s.name, groups=g, tokens_per_device=s.T, experts=s.E, k=s.k,
                              variant="one_device" + suffix, median_ms=est, check_ok=True, estimate=True))
          print(f"{s.name:16s} G={g:<2d} one device, {'kernels' if suffix else 'sorts  '} {est:8.3f} ms (estimate)",
                flush=True)
  dev = jax.devices()[0].device_kind.replace(" ", "_")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"rounding_group_probe_{dev}.json"), "w") as fh:
    json.dump(dict(device=dev, jax=jax.__version__, records=records), fh, indent=1)
  return records


if __name__ == "__main__":
  main()
