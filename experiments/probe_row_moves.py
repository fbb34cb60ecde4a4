"""The dropless layer's four row moves at the bench_moe_layer shapes, on one GPU, in one run.

On the layout the layer uses (dropless_placement, 128-row blocks, routing from gumbel noise): the
forward gather x -> buffer (XLA's filling gather against the row_moves Pallas kernel, in several
tile configs), and XLA's combine buffer -> y, the gather's transpose dx = sum_j dbuf[rows] and the
combine's transpose (dbuf and the row dots), to show how near their bytes' time each runs. Each
kernel variant is checked bit-equal to XLA's gather and timed with peers.common.Timer; GB/s counts
the bytes each must move.

  python experiments/probe_row_moves.py [--shapes E64_top8,E64_top1] [--configs 64x128,32x256]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from sparsejax import permute  # noqa: E402
from sparsejax.kernels.row_moves import gather_rows_reference as rm_ref  # noqa: E402
from sparsejax.kernels.row_moves import triton as rm  # noqa: E402

from peers import common  # noqa: E402
from provenance import source_fingerprint  # noqa: E402

SHAPES = {s.name: s for s in [
    common.Shape("E64_top1", 16384, 1024, 4096, 64, 1, False),
    common.Shape("E8_top2", 16384, 2048, 8192, 8, 2, False),
    common.Shape("E64_top8", 8192, 2048, 1024, 64, 8, False),
    common.Shape("tiny", 300, 256, 64, 4, 2, False),  # a CPU check of this script (interpret mode)
]}
INTERPRET = jax.default_backend() != "gpu"


def setup(s):
  ks = jax.random.split(jax.random.key(3), 5)
  ids = jax.lax.top_k(jax.random.gumbel(ks[0], (s.T, s.E)), s.k)[1]
  pl_ = permute.dropless_placement(ids, s.E, block_size=128)
  w = jax.nn.softmax(jax.random.normal(ks[1], (s.T, s.k)), axis=-1)
  x = jax.random.normal(ks[2], (s.T, s.d), jnp.bfloat16)
  buf = jax.random.normal(ks[3], (pl_.num_rows, s.d), jnp.bfloat16)
  dy = jax.random.normal(ks[4], (s.T, s.d), jnp.bfloat16)
  src_slot = permute.source_slots(pl_)
  return dict(ids=ids, rows=pl_.rows, w=w, x=x, buf=buf, dy=dy, src_slot=src_slot,
              src_tok=src_slot // s.k, num_rows=pl_.num_rows)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="E64_top8,E64_top1,E8_top2")
  ap.add_argument("--configs", default="64x128,32x256,16x512,128x128")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
  a = ap.parse_args()
  timer = common.Timer()
  cfgs = [rm.Config(int(c.split("x")[0]), int(c.split("x")[1])) for c in a.configs.split(",")]
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; sparsejax source {source_fingerprint()}")
  out = []
  for name in a.shapes.split(","):
    s = SHAPES[name]
    v = setup(s)
    R, T, d, k = v["num_rows"], s.T, s.d, s.k
    b = 2  # bf16
    moves = {
        # name: (bytes, {variant: fn})
        "gather x->buf": ((R + T) * d * b, {
            "xla": jax.jit(lambda x, src: rm_ref(x, src)),
            **{f"triton_{c.block_rows}x{c.block_d}": jax.jit(lambda x, src, c=c: rm.gather_rows(x, src, c, interpret=INTERPRET))
               for c in cfgs}}, ("x", "src_tok")),
        "combine buf->y": ((T * k + T) * d * b, {
            "xla": jax.jit(lambda buf, rows, w: permute._combine(buf, rows, w).astype(jnp.bfloat16))},
            ("buf", "rows", "w")),
        "dx = sum_j dbuf[rows]": ((T * k + T) * d * b, {
            "xla": jax.jit(lambda buf, rows: permute._gather_rows_bwd((rows, T), buf)[0])},
            ("buf", "rows")),
        "combine bwd (dbuf, dc)": ((3 * R + T) * d * b, {
            "xla": jax.jit(lambda buf, rows, w, src, dy: permute._scatter_rows_bwd((buf, rows, w, src), dy)[::2])},
            ("buf", "rows", "w", "src_slot", "dy")),
    }
    args_of = lambda names: [v[n] for n in names]
    for move, (nbytes, variants, names) in moves.items():
      want = None
      for label, fn in variants.items():
        args = args_of(names)
        got = fn(*args)
        if want is None:
          want, err = got, 0.0
        else:
          err = common.rel_err(got, want)
        t = timer(lambda: fn(*args), jax.block_until_ready)
        rec = dict(shape=name, move=move, variant=label, ms=t["median_s"] * 1e3,
                   gbps=nbytes / t["median_s"] / 1e9, rel_err=err, rows=R)
        out.append(rec)
        print(f"{name:9s} {move:24s} {label:18s} {rec['ms']:8.4f} ms {rec['gbps']:7.0f} GB/s  err {err:.1e}", flush=True)
  with open(os.path.join(a.out, "row_moves_probe.json"), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
