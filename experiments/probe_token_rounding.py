"""Where token rounding's time goes in the E64 layers: the rounding itself, its k + 1 column buffer,
and the products on whole blocks, each timed alone in one process (peers.common.Timer).

Variants, forward+backward of bench_moe_layer's layer (peers/layer.py) unless named fwd:
  routing (fwd)            top_k_routing alone
  rounding (fwd)           top_k_routing + round_to_blocks (exact: ranks by one sort on score)
  rounding_order (fwd)     the same with ranks in token order (the sort-free histogram), not score
  dropless                 the library's layer
  dropless_k+1             the same routing with an extra all-NO_EXPERT column: the buffer's cost
  rounded                  round_to_blocks inside the layer (its extra column as a k + 1-th column)
  rounded_lib              sj.rounded_moe_mlp: the buffer sized for T k + E b/2 assignments
  rounded_order_lib        the same with token-order ranks
  rounded_order            token-order ranks inside the layer
  rounded_fixed            the rounded ids computed outside the timed call: the products' gain alone
Every layer variant's forward is checked against peers/layer.py's float32 reference.

  python experiments/probe_token_rounding.py [--shapes E64_top1,E64_top1_skewed]
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
from sparsejax import permute, token_rounding  # noqa: E402

from peers import common, layer  # noqa: E402
from peers.common import OUT_TOL, rel_err  # noqa: E402
from bench_moe_layer import SHAPES  # noqa: E402


def _order_ranks(keys, scores, num_keys):
  del scores
  return permute.rank_within_expert_histogram(keys[:, None], num_keys, chunk=64)[0][:, 0]


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="E64_top1,E64_top1_skewed")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args(argv)
  timer = common.Timer()
  out = []
  exact_ranks = token_rounding._ranks
  for s in (s for s in SHAPES if s.name in args.shapes.split(",")):
    a = layer.inputs(s)
    x, bias, w_r, w_in, w_out, ct = (a[n] for n in ("x", "bias", "w_r", "w_in", "w_out", "ct"))
    top_k = lambda x, bias, w_r: sj.top_k_routing(sj.router_logits(x, w_r) + bias, s.k)
    fixed = sj.round_to_blocks(jax.jit(top_k)(x, bias, w_r)).expert_ids

    def routings():
      return {
          "dropless": top_k,
          "dropless_k+1": lambda *a: (lambda r: r.replace(
              expert_ids=jnp.pad(r.expert_ids, ((0, 0), (0, 1)), constant_values=-1),
              combine_weights=jnp.pad(r.combine_weights, ((0, 0), (0, 1)))))(top_k(*a)),
          "rounded": lambda *a: sj.round_to_blocks(top_k(*a)),
          "rounded_order": lambda *a: sj.round_to_blocks(top_k(*a)),
          "rounded_lib": top_k,
          "rounded_order_lib": top_k,
          "rounded_fixed": lambda *a: (lambda r: r.replace(
              expert_ids=fixed, combine_weights=jnp.where(
                  fixed >= 0, jnp.take_along_axis(r.router_probs, jnp.maximum(fixed, 0), axis=1), 0.0)))(top_k(*a)),
      }

    def run(name, fn, *fargs):
      t = timer(lambda: fn(*fargs), jax.block_until_ready)
      rec = dict(shape=s.name, variant=name, median_ms=t["median_s"] * 1e3, timing=t)
      return rec

    for name, route in [("routing (fwd)", top_k), ("rounding (fwd)", lambda *a: sj.round_to_blocks(top_k(*a))),
                        ("rounding_order (fwd)", lambda *a: sj.round_to_blocks(top_k(*a)))]:
      token_rounding._ranks = _order_ranks if "order" in name else exact_ranks
      rec = run(name, jax.jit(route), x, bias, w_r)
      out.append(rec)
      print(f"{s.name:16s} {name:22s} {rec['median_ms']:8.3f} ms", flush=True)
    for name, route in routings().items():
      token_rounding._ranks = _order_ranks if "order" in name else exact_ranks

      def lay(x, bias, w_r, w_in, w_out, route=route, lib=name.endswith("_lib")):
        r = route(x, bias, w_r)
        if lib:
          y, stats = sj.rounded_moe_mlp(x, r, w_in, w_out)
          return y, stats, sj.round_to_blocks(r)
        y, stats = sj.moe_mlp(x, r.expert_ids, r.combine_weights, w_in, w_out)
        return y, stats, r

      def loss(x, bias, w_r, w_in, w_out, ct, lay=lay):
        y, stats, r = lay(x, bias, w_r, w_in, w_out)
        return jnp.sum(jnp.tanh(y.astype(jnp.float32)) * ct.astype(jnp.float32)), stats

      fwd = jax.jit(lambda *a, lay=lay: lay(*a))
      y, stats, r = fwd(x, bias, w_r, w_in, w_out)
      err = rel_err(y, layer.reference(x, r.expert_ids, r.combine_weights, w_in, w_out, None))
      ids = np.asarray(r.expert_ids)
      rows = int(np.sum(np.asarray(stats.tokens_per_expert)))
      blocks = int(np.sum(-(-np.asarray(stats.tokens_per_expert) // 128)))
      fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4), has_aux=True))
      rec = run(name, fb, x, bias, w_r, w_in, w_out, ct)
      rec.update(rel_err=err, check_ok=bool(err < OUT_TOL), rows=rows, row_blocks=blocks,
                 dropped=int(np.sum(ids[:, :s.k] < 0)), added=int(np.sum(ids[:, s.k:] >= 0)) if ids.shape[1] > s.k else 0)
      out.append(rec)
      print(f"{s.name:16s} {name:22s} {rec['median_ms']:8.3f} ms fwd+bwd  rows {rows} blocks {blocks} "
            f"dropped {rec['dropped']} added {rec['added']} err {err:.1e}{'' if rec['check_ok'] else ' CHECK FAILED'}",
            flush=True)
  token_rounding._ranks = exact_ranks
  dev = jax.devices()[0].device_kind.replace(" ", "_")
  with open(os.path.join(args.out, f"token_rounding_probe_{dev}.json"), "w") as fh:
    json.dump(dict(device=dev, jax=jax.__version__, records=out), fh, indent=1)


if __name__ == "__main__":
  main()
