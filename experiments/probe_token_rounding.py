"""Where token rounding's time goes in the E64 layers: the rounding itself, its k + 1 column buffer,
and the products on whole blocks, each timed alone in one process (peers.common.Timer).

Variants, forward+backward of bench_moe_layer's layer (peers/layer.py) unless named fwd:
  routing (fwd)            top_k_routing alone
  rounding (fwd)           top_k_routing + round_to_blocks, its moves by the Pallas kernel (impl "auto" on a GPU)
  rounding_xla (fwd)       the same with the moves by one sort in XLA ops (impl "xla"); checked equal to the above
  dropless                 the library's layer
  dropless_k+1             the same routing with an extra all-NO_EXPERT column: the buffer's cost
  rounded                  round_to_blocks inside the layer (its extra column as a k + 1-th column)
  rounded_lib              sj.rounded_moe_mlp: the buffer sized for T k + E b/2 assignments
  rounded_xla_lib          the same with rounding's moves by the XLA sort
  rounded_fixed            the rounded ids computed outside the timed call: the products' gain alone
  capacity                 the capacity-factor 1.0 layer (drops what overflows), the baseline rounding should reach
Every layer variant's forward is checked against peers/layer.py's float32 reference.

The layer variants are compiled and checked first, then timed in --rounds rounds, every variant once a round and
the order reversed every other round (a clock that drifts under the power cap then favours none); each variant's
figure is the median over rounds.

  python experiments/probe_token_rounding.py [--shapes E64_top1,E64_top1_skewed] [--variants a,b] [--rounds 5]
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

import sparsejax as sj  # noqa: E402
from sparsejax import token_rounding  # noqa: E402

from peers import common, layer  # noqa: E402
from peers.common import OUT_TOL, rel_err  # noqa: E402
from bench_moe_layer import SHAPES  # noqa: E402


def _rounding(impl):
  """round_to_blocks with its moves by `impl`, where rounded_moe_mlp calls it too."""
  return functools.partial(_ROUND, impl=impl)


_ROUND = token_rounding.round_to_blocks


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="E64_top1,E64_top1_skewed")
  ap.add_argument("--variants", default=None, help="comma-separated; default: all")
  ap.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds of the layer variants")
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  args = ap.parse_args(argv)
  timer = common.Timer()
  out = []
  wanted = lambda name: args.variants is None or name.split(" ")[0] in args.variants.split(",")
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
          "rounded_lib": top_k,
          "rounded_xla_lib": top_k,
          "capacity": top_k,
          "rounded_fixed": lambda *a: (lambda r: r.replace(
              expert_ids=fixed, combine_weights=jnp.where(
                  fixed >= 0, jnp.take_along_axis(r.router_probs, jnp.maximum(fixed, 0), axis=1), 0.0)))(top_k(*a)),
      }

    def run(name, fn, *fargs):
      t = timer(lambda: fn(*fargs), jax.block_until_ready)
      rec = dict(shape=s.name, variant=name, median_ms=t["median_s"] * 1e3, timing=t)
      return rec

    moves = {}
    for name, route in [("routing (fwd)", top_k), ("rounding (fwd)", lambda *a: _rounding("auto")(top_k(*a))),
                        ("rounding_xla (fwd)", lambda *a: _rounding("xla")(top_k(*a)))]:
      if not wanted(name):
        continue
      fn = jax.jit(route)
      if name != "routing (fwd)":
        moves[name] = jax.device_get(fn(x, bias, w_r))
      rec = run(name, fn, x, bias, w_r)
      out.append(rec)
      print(f"{s.name:16s} {name:22s} {rec['median_ms']:8.3f} ms", flush=True)
    if len(moves) == 2:  # the kernel's moves must be the sort's: ids exactly, weights to float32 rounding
      a, b = moves.values()
      same_ids = bool(np.array_equal(a.expert_ids, b.expert_ids))
      w_err = float(np.max(np.abs(np.asarray(a.combine_weights, np.float32) - np.asarray(b.combine_weights, np.float32))))
      same = same_ids and w_err <= 1e-6
      out.append(dict(shape=s.name, variant="rounding_moves_equal", check_ok=same, ids_equal=same_ids,
                      weights_max_abs_diff=w_err))
      print(f"{s.name:16s} rounding kernel == sort: ids {same_ids}, weights max |diff| {w_err:.1e}"
            f"{'' if same else ' CHECK FAILED'}", flush=True)
    layers = []
    for name, route in routings().items():
      if not wanted(name):
        continue
      token_rounding.round_to_blocks = _rounding("xla" if "xla" in name else "auto")

      cf = 1.0 if name == "capacity" else None

      def lay(x, bias, w_r, w_in, w_out, route=route, lib=name.endswith("_lib"), cf=cf):
        r = route(x, bias, w_r)
        if cf is not None:
          return (*sj.moe_mlp(x, r.expert_ids, r.combine_weights, w_in, w_out, capacity_factor=cf), r)
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
      cap = None if cf is None else sj.capacity(s.T, s.E, s.k, cf)
      err = rel_err(y, layer.reference(x, r.expert_ids, r.combine_weights, w_in, w_out, cap))
      ids = np.asarray(r.expert_ids)
      rows = int(np.sum(np.asarray(stats.tokens_per_expert)))
      blocks = int(np.sum(-(-np.asarray(stats.tokens_per_expert) // 128)))
      fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4), has_aux=True))
      jax.block_until_ready(fb(x, bias, w_r, w_in, w_out, ct))  # compiled while round_to_blocks is patched
      rec = dict(shape=s.name, variant=name, fb=fb)
      rec.update(rel_err=err, check_ok=bool(err < OUT_TOL), rows=rows, row_blocks=blocks,
                 dropped=int(np.sum(ids[:, :s.k] < 0)), added=int(np.sum(ids[:, s.k:] >= 0)) if ids.shape[1] > s.k else 0)
      layers.append(rec)
    token_rounding.round_to_blocks = _ROUND
    for i in range(args.rounds):
      for rec in (layers if i % 2 == 0 else layers[::-1]):
        rec.setdefault("rounds_ms", []).append(run(rec["variant"], rec["fb"], x, bias, w_r, w_in, w_out, ct)["median_ms"])
    for rec in layers:
      del rec["fb"]
      rec["median_ms"] = float(np.median(rec["rounds_ms"]))
      out.append(rec)
      print(f"{s.name:16s} {rec['variant']:22s} {rec['median_ms']:8.3f} ms fwd+bwd  rows {rec['rows']} blocks "
            f"{rec['row_blocks']} dropped {rec['dropped']} added {rec['added']} err {rec['rel_err']:.1e}"
            f"{'' if rec['check_ok'] else ' CHECK FAILED'}  rounds {' '.join(f'{t:.3f}' for t in rec['rounds_ms'])}",
            flush=True)
  token_rounding.round_to_blocks = _ROUND
  dev = jax.devices()[0].device_kind.replace(" ", "_")
  with open(os.path.join(args.out, f"token_rounding_probe_{dev}.json"), "w") as fh:
    json.dump(dict(device=dev, jax=jax.__version__, records=out), fh, indent=1)


if __name__ == "__main__":
  main()
