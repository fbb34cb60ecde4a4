"""The token dispatch's receive-side placement alone: why it costs 16x more a step than one GPU's placement.

On 2 x H200 (sixtieth session, `results/ep_train_h200_x2_top8_placement_ops.json`), xs-moe at top-8 spent 4.3 ms a
step in "placement" under the token dispatch against 0.25 ms on one GPU, for twice the assignments. Nearly all of
it was one fusion a layer, 0.52 ms each: the sort-free ranks' in-chunk count (`rank_within_expert_histogram`, a
[chunks, 64] sum of a [chunks, 64, 64] comparison), whose operand there is the select that makes the received ids
out of the exchanged float rows; on one GPU the same reduce, over ids that arrive as an int32 array, took
0.014 ms at half the size. This probe times that placement on one device, with the received ids made as
`parallel.py` makes them, against forms that would show where the time goes:

  in_jit          the received ids from the packed float rows inside the program, then the library's GPU placement
                  as it was (dropless_placement_histogram, chunk 64, 128-row blocks): the step's form
  ids_barrier     the same with the ids through an optimization barrier first, so no fusion reaches back into
                  the select that makes them
  ids_given       the ids as an int32 argument (the one-GPU layer's case)
  in_jit_chunk32  in_jit with 32-assignment chunks (half the comparisons): the library's chunk since the
                  sixty-first session (permute.histogram_chunk), 11x faster here on 2 x H200
  argsort         the placement by one stable argsort (the library's form off the GPU)
  argsort_narrow  the argsort on the ids as uint8 (probe_cub_sorts.unsigned_argsort_ranks: XLA:GPU hands it
                  to CUB's radix sort)

With --gpus N (N > 1; the peers are then the N devices) two more run as the step runs them, inside shard_map on a
1 x N mesh, the ids read from a dense all-to-all's output:

  exchanged          each device's packed rows and row counts through the all-to-all, then in_jit's placement
  exchanged_barrier  the same with ids_barrier's barrier

Every variant's rows and group sizes are checked equal to argsort's (the obviously right form; on each device for
the exchanged ones). The compiled program of each is saved beside the JSON
(`recv_placement_<variant>_<device>.hlo.txt`) to read its fusions.

  python experiments/probe_recv_placement.py [--peers 2] [--slots 32768] [--k 8] [--experts-per-peer 32] [--gpus 2]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from sparsejax import exchange, parallel, permute  # noqa: E402
from sparsejax import mesh as meshlib  # noqa: E402

from peers import common  # noqa: E402
from probe_cub_sorts import unsigned_argsort_ranks  # noqa: E402

BLOCK = 128
VARIANTS = ("in_jit", "ids_barrier", "ids_given", "in_jit_chunk32", "argsort", "argsort_narrow")
EXCHANGED = ("exchanged", "exchanged_barrier")


def received_ids(meta, recv_rows, k: int):
  """[P S, k] local ids as the token dispatch makes them (parallel.received_token_routing): the packed rows'
  first k columns, NO_EXPERT past each peer's received rows."""
  assert meta.shape[2] == 2 * k, (meta.shape, k)
  return parallel.received_token_routing(meta, recv_rows)[0]


def histogram(ids, experts: int, chunk: int = 64):
  """The library's placement on a GPU (permute._ranks' sort-free histogram), at a given chunk."""
  p = permute.dropless_placement_histogram(ids, experts, block_size=BLOCK, chunk=chunk)
  return p.rows, p.group_sizes


def variants(k: int, experts: int):
  """{name: (fn, takes_ids)}: fn(meta, recv_rows) -> (rows, group_sizes), or fn(ids) where takes_ids."""
  histogram_ = functools.partial(histogram, experts=experts)

  def argsort(ids, ranks=permute.rank_within_expert):
    rank, counts = ranks(ids, experts)
    p = permute._dropless_from_ranks(ids, rank, counts, experts, BLOCK)
    return p.rows, p.group_sizes

  return {
      "in_jit": (lambda meta, rr: histogram_(received_ids(meta, rr, k)), False),
      "ids_barrier": (lambda meta, rr: histogram_(jax.lax.optimization_barrier(received_ids(meta, rr, k))), False),
      "ids_given": (histogram_, True),
      "in_jit_chunk32": (lambda meta, rr: histogram_(received_ids(meta, rr, k), chunk=32), False),
      "argsort": (lambda meta, rr: argsort(received_ids(meta, rr, k)), False),
      "argsort_narrow": (lambda meta, rr: argsort(received_ids(meta, rr, k), unsigned_argsort_ranks), False),
  }


def inputs(peers: int, slots: int, k: int, experts: int, fill: float, seed: int = 0):
  """What every peer sends every peer: packed float rows [P src, P dst, S, 2k] (k distinct local ids, then k
  weights) and the rows each block holds [P src, P dst]: peer 0's blocks fill their S slots, the others' `fill` of
  them (past them the rows are garbage, as an exchange leaves them). Peer d receives [:, d]."""
  rng = np.random.default_rng(seed)
  ids = np.argsort(rng.random((peers, peers, slots, experts)), axis=-1)[..., :k]  # k distinct experts a row
  meta = np.concatenate([ids, rng.random((peers, peers, slots, k))], axis=-1).astype(np.float32)
  sent = np.repeat(np.array([slots] + [int(slots * fill)] * (peers - 1), np.int32)[:, None], peers, axis=1)
  return jnp.asarray(meta), jnp.asarray(sent)


def exchanged(k: int, experts: int, mesh, layout, barrier: bool):
  """fn(meta [P, P, S, 2k], sent [P, P]) -> each device's (rows, group sizes), stacked: device s sends meta[s, d]
  to d through the dense all-to-all, as the token dispatch does, and places what it receives."""
  spec = jax.sharding.PartitionSpec(meshlib.EXPERT)

  def body(meta, sent):
    recv_meta = exchange.dense_all_to_all(meta[0], layout, False)  # [P src, S, 2k]
    recv_rows = exchange.dense_all_to_all(sent[0], layout, False)  # [P src]
    ids = received_ids(recv_meta, recv_rows, k)
    ids = jax.lax.optimization_barrier(ids) if barrier else ids
    rows, sizes = histogram(ids, experts)
    return rows[None], sizes[None]

  return parallel._shard_map(body, mesh, (spec, spec), (spec, spec))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--peers", type=int, default=2, help="sources of the received rows (with --gpus: the devices)")
  ap.add_argument("--gpus", type=int, default=1, help="N > 1: also the exchanged variants on a 1 x N mesh")
  ap.add_argument("--slots", type=int, default=32768, help="rows a peer's block holds (the sender's tokens)")
  ap.add_argument("--k", type=int, default=8, help="columns a row: min(top_k, experts a peer)")
  ap.add_argument("--experts-per-peer", type=int, default=32)
  ap.add_argument("--fill", type=float, default=0.5, help="received rows over slots, peers but the first")
  ap.add_argument("--variants", default=None, help="comma-separated, of " + ", ".join(VARIANTS + EXCHANGED)
                  + " (default: all, the exchanged ones with --gpus)")
  ap.add_argument("--smoke", action="store_true", help="a small problem and a one-shot timer (any machine)")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args(argv)
  if args.gpus > 1:
    if args.gpus > len(jax.devices()):
      ap.error(f"--gpus {args.gpus}: only {len(jax.devices())} devices are visible")
    args.peers = args.gpus
  names = (args.variants or ",".join(VARIANTS + (EXCHANGED if args.gpus > 1 else ()))).split(",")
  if unknown := [n for n in names if n not in VARIANTS + EXCHANGED]:
    ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS + EXCHANGED)}")
  if args.gpus < 2 and set(names) & set(EXCHANGED):
    ap.error(f"{', '.join(EXCHANGED)} need --gpus 2 or more")
  if not 1 <= args.k <= args.experts_per_peer or args.peers < 1 or args.slots < 1 or not 0 <= args.fill <= 1:
    ap.error("needs 1 <= k <= experts-per-peer, peers >= 1, slots >= 1 and 0 <= fill <= 1")
  if args.smoke:
    args.slots, args.k, args.experts_per_peer = 256, 4, 8
  timer = common.SMOKE_TIMER if args.smoke else common.Timer()
  sent_meta, sent = inputs(args.peers, args.slots, args.k, args.experts_per_peer, args.fill)
  meta, recv = sent_meta[:, 0], sent[:, 0]  # what peer 0 receives: the one-device variants' problem
  ids = jax.jit(received_ids, static_argnums=2)(meta, recv, args.k)
  fns = variants(args.k, args.experts_per_peer)
  argsort = jax.jit(fns["argsort"][0])
  want = [[np.asarray(a) for a in argsort(sent_meta[:, d], sent[:, d])] for d in range(args.peers)]
  if args.gpus > 1:
    mesh = meshlib.make_expert_mesh(1, args.gpus, devices=jax.devices()[:args.gpus])
    layout = meshlib.expert_layout(mesh, args.experts_per_peer * args.gpus)
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(meshlib.EXPERT))
    on_mesh = (jax.device_put(sent_meta, sharded), jax.device_put(sent, sharded))
    for name in EXCHANGED:
      fns[name] = (exchanged(args.k, args.experts_per_peer, mesh, layout, name.endswith("barrier")), None)
  dev = jax.devices()[0].device_kind.replace(" ", "_")
  os.makedirs(args.out, exist_ok=True)
  records = []
  for name in names:
    fn, takes_ids = fns[name]
    call_args = on_mesh if takes_ids is None else (ids,) if takes_ids else (meta, recv)
    jitted = jax.jit(fn)
    hlo = jitted.lower(*call_args).compile().as_text()
    with open(os.path.join(args.out, f"recv_placement_{name}_{dev}.hlo.txt"), "w") as fh:
      fh.write(hlo)
    rows, sizes = jitted(*call_args)
    if takes_ids is not None:
      rows, sizes = np.asarray(rows)[None], np.asarray(sizes)[None]
    equal = all(np.array_equal(np.asarray(rows[d]), want[d][0]) and np.array_equal(np.asarray(sizes[d]), want[d][1])
                for d in range(len(rows)))
    t = timer(lambda: jitted(*call_args), jax.block_until_ready)
    records.append(dict(variant=name, peers=args.peers, devices=len(rows), slots=args.slots, k=args.k,
                        experts_per_peer=args.experts_per_peer, fill=args.fill, assignments=int(ids.size),
                        median_ms=t["median_s"] * 1e3, equal_to_argsort=equal,
                        fusions=hlo.count(" fusion("), timing=t))
    print(f"{name:>15}: {t['median_s'] * 1e3:8.3f} ms  (rows and group sizes equal argsort's: {equal})", flush=True)
  stem = f"recv_placement_probe_{dev}{f'_x{args.gpus}' if args.gpus > 1 else ''}"
  with open(os.path.join(args.out, stem + ".json"), "w") as fh:
    json.dump(dict(device=dev, jax=jax.__version__, records=records), fh, indent=1)
  return records


if __name__ == "__main__":
  main()
