"""The expert-parallel exchange alone: dense all-to-all of the whole [P, S, d] buffer against
ragged_all_to_all of the real rows (as one update per peer, or split into chunks), on all GPUs.

Every device holds T tokens routed top-k over E experts (random logits); its send buffer has S =
T * min(k, E/P) rows per peer (the layer's default bound) and the rows routed there first. Each
variant's result is checked against the dense one. Median of --iters calls after --warmup.

  python experiments/bench_exchange.py                       # 2+ GPUs
  XLA_FLAGS=... python experiments/bench_exchange.py         # to try XLA's ragged-all-to-all options
  python experiments/bench_exchange.py --smoke               # CPU, 8 host devices (emulated ragged op)
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if "--smoke" in sys.argv:
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  os.environ["JAX_PLATFORMS"] = "cpu"
HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sparsejax as sj  # noqa: E402
from peers.common import time_fn  # noqa: E402
from sparsejax import mesh as meshlib, parallel  # noqa: E402
from sparsejax.exchange import dense_all_to_all, ragged_all_to_all_rows  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tokens-per-gpu", type=int, default=16384)
  p.add_argument("--d-model", type=int, default=1024)
  p.add_argument("--experts", type=int, default=64)
  p.add_argument("--top-k", type=int, default=1)
  p.add_argument("--chunks", default="1,8,64")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--smoke", action="store_true")
  a = p.parse_args(argv)
  if a.smoke:
    a.tokens_per_gpu, a.d_model, a.experts, a.warmup, a.iters = 64, 16, 8, 1, 2
  n = len(jax.devices())
  mesh = meshlib.make_expert_mesh(1, n)
  layout = meshlib.expert_layout(mesh, a.experts)
  t, k, d = a.tokens_per_gpu, a.top_k, a.d_model
  slots = parallel.distinct_slots(t, k, a.experts // n)
  tok = layout.sharding(layout.tokens)
  ids = jax.jit(lambda key: sj.top_k_routing(jax.random.normal(key, (t * n, a.experts)), k).expert_ids,
                out_shardings=tok)(jax.random.key(0))
  x = jax.jit(lambda key: jax.random.normal(key, (t * n, d)).astype(jnp.bfloat16), out_shardings=tok)(
      jax.random.key(1))

  def body(x, ids, *, how, chunks=1):
    send, sent = parallel.peer_placement(ids, a.experts, n, slots)
    buf = sj.permute.gather_rows(x, send).reshape(n, slots, d)
    if how == "dense":
      return dense_all_to_all(buf, layout, False).reshape(-1, d)
    recv = dense_all_to_all(sent, layout, False)
    return ragged_all_to_all_rows(buf, sent.sum(1), recv.sum(1), layout, chunks=chunks).reshape(-1, d)

  variants = [("dense", dict(how="dense"))] + [(f"ragged chunks={c}", dict(how="ragged", chunks=int(c)))
                                               for c in a.chunks.split(",")]
  spec = layout.tokens
  want, rows = None, []
  for name, kw in variants:
    f = jax.jit(parallel._shard_map(lambda x, i, kw=kw: body(x, i, **kw), mesh, (spec, spec), spec, check=False))
    try:
      out = f(x, ids)
      sec = time_fn(f, x, ids, warmup=a.warmup, iters=a.iters)
    except Exception as e:  # noqa: BLE001 -- report and go on to the next variant
      rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
      print(json.dumps(rows[-1]), flush=True)
      continue
    want = out if want is None else want
    rows.append({"variant": name, "ms": 1e3 * sec, "equal_to_dense": bool(jnp.array_equal(out, want)),
                 "buffer_mb_per_gpu": n * slots * d * 2 / 1e6})
    print(json.dumps(rows[-1]), flush=True)
  print(f"\n{n} x {jax.devices()[0].device_kind}, T={t}/GPU, d={d}, E={a.experts}, top-{k}, S={slots}/peer, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print("| variant | ms (incl. gather) | equal to dense |\n|---|---|---|")
  for r in rows:
    print(f"| {r['variant']} | {r.get('ms', float('nan')):.3f} | {r.get('equal_to_dense', r.get('error'))} |")
  return rows


if __name__ == "__main__":
  main()
