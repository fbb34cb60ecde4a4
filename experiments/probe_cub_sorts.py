"""The library's sorts as sorts XLA:GPU hands to CUB's radix sort, against the library's forms, in one
process, every output checked equal to the library's on the same routing.

XLA rewrites a sort to CUB when its comparator is one `<` on the first operand and the sort is long
enough (jax 0.11.2's XLA on Hopper: any 8- or 16-bit key, a 32-bit key above 22,000 items). Token
rounding's ranks come from one sort on two keys, which XLA runs itself; the placement's argsort
(int32 ids) stays XLA's below 22,000 assignments. Parts:
  ranks     the placement's ranks: the sort-free histogram (the library's on GPUs), the int32 argsort
            (its CPU form), and the argsort on ids as uint8/16 (always CUB)
  rounding  round_to_blocks: ranks by the library's one two-key sort, by two stable passes (score,
            then expert, as uint32 and uint8 keys: two CUB sorts), or by one sort by score followed by
            the placement's sort-free histogram ranks over the experts in that order
  layers    bench_moe_layer's layer forward+backward, interleaved rounds: dropless with the histogram
            or the uint argsort for its ranks, rounded with either rounding sort, capacity 1.0
The ranks and rounding parts time `--reps` calls on different routings in one program, and count
the compiled program's CUB sorts and XLA sort ops. Rounding's sort now runs only in its XLA form
(kernels.block_rounding.reference; a Pallas kernel replaced it on GPUs in the fifty-fifth session), so
every rounding variant here runs that form.

  python experiments/probe_cub_sorts.py [--parts ranks,rounding,layers] [--shapes ...] [--rounds 3]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sparsejax as sj  # noqa: E402
from sparsejax import permute  # noqa: E402
from sparsejax.kernels.block_rounding import op as rounding_op, reference as rounding_reference  # noqa: E402

from peers import common, layer  # noqa: E402
from peers.common import OUT_TOL, rel_err  # noqa: E402
from bench_moe_layer import SHAPES, SMOKE_SHAPES  # noqa: E402


def unsigned_argsort_ranks(expert_ids, num_experts):
  """permute.rank_within_expert with its argsort's key as uint8/16/32 (tried: CUB's radix sort)."""
  flat = expert_ids.reshape(-1)
  valid = (flat >= 0) & (flat < num_experts)
  key = jnp.where(valid, flat, num_experts)
  order = jax.lax.sort((_narrow(key, num_experts + 1), jnp.arange(flat.shape[0], dtype=jnp.int32)),
                       num_keys=1, is_stable=True)[1]
  counts = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  starts = jnp.cumsum(counts) - counts
  sorted_key = key[order]
  start = jnp.where(sorted_key < num_experts, starts[jnp.minimum(sorted_key, num_experts - 1)], 0)
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(flat.shape[0], dtype=jnp.int32) - start)
  return rank.reshape(expert_ids.shape), counts


def _narrow(keys, bound):
  """keys in [0, bound) as the narrowest unsigned type (fewer radix passes)."""
  return keys.astype(jnp.uint8 if bound <= 1 << 8 else jnp.uint16 if bound <= 1 << 16 else jnp.uint32)


def _descending_key(scores):
  """uint32 keys whose ascending order is lax.sort's order of -scores (zeros equal, NaNs last)."""
  neg = -scores.astype(jnp.float32)
  neg = jnp.where(neg == 0, 0.0, neg)
  neg = jnp.where(jnp.isnan(neg), jnp.nan, neg)
  bits = jax.lax.bitcast_convert_type(neg, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def two_pass_rounding_ranks(keys, scores, num_keys):
  """ranks_within (rounding's ranks) as two stable key-value sorts, score then key (tried: each one CUB sort)."""
  n = keys.shape[0]
  index = jnp.arange(n, dtype=jnp.int32)
  by_score = jax.lax.sort((_descending_key(scores), index), num_keys=1, is_stable=True)[1]
  order = jax.lax.sort((_narrow(keys[by_score], num_keys), by_score), num_keys=1, is_stable=True)[1]
  position = jnp.zeros((n,), jnp.int32).at[order].set(index)
  counts = jnp.zeros((num_keys,), jnp.int32).at[keys].add(1)
  starts = jnp.cumsum(counts) - counts
  return position - starts[keys]


def score_sort_histogram_ranks(keys, scores, num_keys):
  """ranks_within (rounding's ranks) as one stable sort by score (uint32 key: CUB above 22,000 items), then the
  placement's sort-free histogram ranks over the keys in that order (tried)."""
  n = keys.shape[0]
  index = jnp.arange(n, dtype=jnp.int32)
  by_score = jax.lax.sort((_descending_key(scores), index), num_keys=1, is_stable=True)[1]
  in_order = permute.rank_within_expert_histogram(keys[by_score][:, None], num_keys, chunk=64)[0][:, 0]
  return jnp.zeros((n,), jnp.int32).at[by_score].set(in_order)


LIBRARY_RANKS = {"permute": permute._ranks, "rounding": rounding_reference.ranks_within}
PLACEMENT_RANKS = {
    # the library's on GPUs: permute.histogram_chunk's chunk (a fixed 64 before the sixty-first session)
    "histogram": lambda ids, E: permute.rank_within_expert_histogram(ids, E),
    "argsort_int32": permute.rank_within_expert,
    "argsort_uint": unsigned_argsort_ranks,
}
ROUNDING_RANKS = {"two_key_sort": rounding_reference.ranks_within, "two_pass_uint": two_pass_rounding_ranks,
                  "score_sort_hist": score_sort_histogram_ranks}


@contextlib.contextmanager
def library_ranks(placement=None, rounding=None):
  """permute._ranks and rounding's ranks_within replaced while tracing (the library reads both then), rounding held
  to its XLA form (the sort), and all restored however the block ends, so a failed variant leaves the library as
  it was."""
  runs_kernel = rounding_op.runs_kernel
  permute._ranks = placement or LIBRARY_RANKS["permute"]
  rounding_reference.ranks_within = rounding or LIBRARY_RANKS["rounding"]
  rounding_op.runs_kernel = lambda impl="auto": False
  try:
    yield
  finally:
    permute._ranks, rounding_reference.ranks_within = LIBRARY_RANKS["permute"], LIBRARY_RANKS["rounding"]
    rounding_op.runs_kernel = runs_kernel


def sorts_of(jitted, *args) -> str:
  """The compiled program's sorts: CUB custom calls (jax 0.11's XLA names them xla.gpu.ext.cub_sort_*;
  older ones __cub$DeviceRadixSort) and XLA's own sort ops."""
  text = jitted.lower(*args).compile().as_text()
  cub = len(re.findall(r'custom_call_target="[^"]*(?:cub_sort|DeviceRadixSort)[^"]*"', text))
  xla = len(re.findall(r"[])] sort\(", text))
  return f"cub {cub} xla {xla}"


def stacked(fn, reps: int):
  """fn over reps inputs in one jitted program: its time over reps is device work and in-program
  launches, without the host's dispatch of a 50-us program."""
  return jax.jit(lambda stack: [fn(jax.tree.map(lambda a: a[i], stack)) for i in range(reps)])


def median_ms(timer, fn) -> float:
  return timer(fn, jax.block_until_ready)["median_s"] * 1e3


def _id_stack(s, reps):
  a = layer.inputs(s)
  logits = sj.router_logits(a["x"], a["w_r"]) + a["bias"]
  noise = jax.random.gumbel(jax.random.key(3), (reps, s.T, s.E))
  return jax.vmap(lambda z: sj.top_k_routing(logits + z, s.k))(noise)


def part_ranks(shapes, timer, reps, log, out):
  for s in shapes:
    ids = _id_stack(s, reps).expert_ids
    valid = np.asarray((ids >= 0) & (ids < s.E))
    ref = None
    for name, fn in PLACEMENT_RANKS.items():
      f = stacked(lambda i, fn=fn: fn(i, s.E), reps)
      got = f(ids)
      rank, counts = np.stack([np.asarray(g[0]) for g in got]), np.stack([np.asarray(g[1]) for g in got])
      ref = ref or (rank, counts)
      ok = bool(np.array_equal(rank[valid], ref[0][valid]) and np.array_equal(counts, ref[1]))
      us = median_ms(timer, lambda: f(ids)) * 1e3 / reps
      sorts = sorts_of(f, ids)
      out.append(dict(part="ranks", shape=s.name, variant=name, us=us, sorts=sorts, equal=ok))
      log(f"ranks     {s.name:16s} {name:16s} {us:8.1f} us a call  ({sorts} in {reps} calls)  equal {ok}")


def part_rounding(shapes, timer, reps, log, out):
  for s in shapes:
    routings = _id_stack(s, reps)
    ref = None
    for name, ranks in ROUNDING_RANKS.items():
      f = stacked(lambda r: sj.round_to_blocks(r), reps)
      with library_ranks(rounding=ranks):  # traced, lowered and timed with these ranks
        got = f(routings)
        sorts = sorts_of(f, routings)
        us = median_ms(timer, lambda: f(routings)) * 1e3 / reps
      ids = np.stack([np.asarray(g.expert_ids) for g in got])
      w = np.stack([np.asarray(g.combine_weights) for g in got])
      ref = ref or (ids, w)
      ok = bool(np.array_equal(ids, ref[0]) and np.array_equal(w, ref[1]))
      out.append(dict(part="rounding", shape=s.name, variant=name, us=us, sorts=sorts, equal=ok))
      log(f"rounding  {s.name:16s} {name:16s} {us:8.1f} us a call  ({sorts} in {reps} calls)  equal {ok}")


LAYER_VARIANTS = {  # name: (layer label, placement ranks, rounding ranks)
    "dropless_histogram": ("dropless", PLACEMENT_RANKS["histogram"], None),
    "dropless_argsort_uint": ("dropless", unsigned_argsort_ranks, None),
    "rounded_two_key_sort": ("rounded", PLACEMENT_RANKS["histogram"], rounding_reference.ranks_within),
    "rounded_two_pass_uint": ("rounded", PLACEMENT_RANKS["histogram"], two_pass_rounding_ranks),
    "rounded_all_uint": ("rounded", unsigned_argsort_ranks, two_pass_rounding_ranks),
    "rounded_score_sort_hist": ("rounded", PLACEMENT_RANKS["histogram"], score_sort_histogram_ranks),
    "capacity_1.0": ("capacity_1.0", None, None),
}


def part_layers(shapes, timer, rounds, variants, log, out):
  for s in shapes:
    a = layer.inputs(s)
    args = (a["x"], a["bias"], a["w_r"], a["w_in"], a["w_out"])
    built, first = {}, {}
    for name, (label, placement, rounding) in ((n, v) for n, v in LAYER_VARIANTS.items() if n in variants):
      impl, cf = layer.parse_variant(label)
      routing, fwd, fwdbwd = layer.functions(s, impl, cf, label == "rounded")  # fresh functions
      with library_ranks(placement, rounding):  # traced here, and timed below, with these ranks
        y, stats = fwd(*args)
        r = routing(*args[:3])
        grads = fwdbwd(*args, a["ct"])[1]
      cap = None if cf is None else sj.capacity(s.T, s.E, s.k, cf)
      err = rel_err(y, layer.reference(a["x"], r.expert_ids, r.combine_weights, a["w_in"], a["w_out"], cap))
      same = label not in first or bool(np.array_equal(np.asarray(y), first[label]))
      first.setdefault(label, np.asarray(y))
      built[name] = (fwdbwd, placement, rounding)
      rec = dict(part="layers", shape=s.name, variant=name, rel_err=err, check_ok=bool(err < OUT_TOL),
                 equal_to_first_of_kind=same, grads_finite=bool(all(bool(jnp.all(jnp.isfinite(g))) for g in grads)),
                 ms=[])
      out.append(rec)
      log(f"layers    {s.name:16s} {name:22s} err {err:.1e} equal {same}")
    recs = {r["variant"]: r for r in out if r["part"] == "layers" and r["shape"] == s.name}
    for _ in range(rounds):
      for name, (fb, placement, rounding) in built.items():
        with library_ranks(placement, rounding):
          recs[name]["ms"].append(median_ms(timer, lambda fb=fb: fb(*args, a["ct"])))
    base = statistics.median(recs["dropless_histogram"]["ms"])
    for name, rec in recs.items():
      rec["median_ms"] = statistics.median(rec["ms"])
      log(f"layers    {s.name:16s} {name:22s} {rec['median_ms']:7.3f} ms fwd+bwd  "
          f"(rounds {', '.join(f'{m:.3f}' for m in rec['ms'])})  dropless_histogram / this {base / rec['median_ms']:.4f}")


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--parts", default="ranks,rounding,layers")
  ap.add_argument("--shapes", default="E64_top1,E64_top1_skewed,E8_top2,E64_top8")
  ap.add_argument("--layer-shapes", default="E64_top1,E64_top1_skewed")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--layer-variants", default=",".join(LAYER_VARIANTS), help="dropless_histogram is the baseline: keep it")
  ap.add_argument("--reps", type=int, default=16, help="calls in one program for the ranks and rounding parts")
  ap.add_argument("--smoke", action="store_true", help="bench_moe_layer's smoke shapes, one quick timing (CPU tests)")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args(argv)
  unknown = set(args.layer_variants.split(",")) - set(LAYER_VARIANTS)
  if unknown or "dropless_histogram" not in args.layer_variants.split(","):
    raise SystemExit(f"--layer-variants: names from {', '.join(LAYER_VARIANTS)}, dropless_histogram among them; "
                     f"got {args.layer_variants!r}.")
  if jax.default_backend() != "gpu" and not args.smoke:
    raise SystemExit("probe_cub_sorts times GPU sorts: run it on a GPU (or --smoke to check it on the CPU).")
  timer = common.SMOKE_TIMER if args.smoke else common.Timer()
  shapes = SMOKE_SHAPES if args.smoke else SHAPES
  if args.smoke:  # both smoke routings for the cheap parts, one for the layers (each variant compiles)
    args.shapes, args.layer_shapes = ",".join(s.name for s in SMOKE_SHAPES), SMOKE_SHAPES[0].name
  pick = lambda names: [s for s in shapes if s.name in names.split(",")]
  parts = args.parts.split(",")
  out = []
  print(f"# probe_cub_sorts on {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  log = lambda line: print(line, flush=True)
  if "ranks" in parts:
    part_ranks(pick(args.shapes), timer, args.reps, log, out)
  if "rounding" in parts:
    part_rounding(pick(args.shapes), timer, args.reps, log, out)
  if "layers" in parts:
    part_layers(pick(args.layer_shapes), timer, args.rounds, args.layer_variants.split(","), log, out)
  dev = jax.devices()[0].device_kind.replace(" ", "_")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"cub_sorts_probe_{dev}.json"), "w") as fh:
    json.dump(dict(device=dev, jax=jax.__version__, records=out), fh, indent=1)
  return out


if __name__ == "__main__":
  main()
