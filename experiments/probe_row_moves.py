"""The dropless layer's four row moves at the bench_moe_layer shapes, on one GPU, in one run.

On the layout the layer uses (dropless_placement, 128-row blocks, routing from gumbel noise): the
forward gather x -> buffer (XLA's filling gather against the row_moves Pallas kernel, in several
tile configs, and the ninth session's kernel before 883519e masked its last block, to time what the masks
cost), and XLA's combine buffer -> y, the gather's transpose dx = sum_j dbuf[rows] and the
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

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

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


def _unmasked_kernel(src_ref, x_ref, out_ref, *, n: int, block_d: int):
  from jax.experimental.pallas import triton as plt
  idx = src_ref[...]
  valid = (idx >= 0) & (idx < n)
  rows = jnp.where(valid, idx, 0)[:, None]
  cols = pl.program_id(1) * block_d + jax.lax.broadcasted_iota(jnp.int32, (1, block_d), 1)
  mask = jnp.broadcast_to(valid[:, None], out_ref.shape)
  out_ref[...] = plt.load(x_ref.at[rows, cols], mask=mask, other=0)


@functools.partial(jax.jit, static_argnames="cfg")
def unmasked_gather(x, src, cfg: rm.Config):
  """rm.gather_rows as it was before 883519e: no mask on the last block's src load and store, so only
  right where rows % block_rows == 0 (every layout here: 128-row blocks). A timing peer, not a kernel."""
  r, (n, d) = src.shape[0], x.shape
  if r % cfg.block_rows or INTERPRET:
    raise ValueError(f"the unmasked gather needs a GPU and rows ({r}) a multiple of {cfg.block_rows}")
  from jax.experimental.pallas import triton as plt
  bd = rm.block_d_for(d, cfg)
  return pl.pallas_call(
      functools.partial(_unmasked_kernel, n=n, block_d=bd),
      grid=(r // cfg.block_rows, d // bd),
      in_specs=[pl.BlockSpec((cfg.block_rows,), lambda i, j: (i,)), pl.no_block_spec],
      out_specs=pl.BlockSpec((cfg.block_rows, bd), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((r, d), x.dtype),
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1), name="unmasked_gather_rows",
  )(src, x)


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


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="E64_top8,E64_top1,E8_top2")
  ap.add_argument("--configs", default="64x128,32x256,16x512,128x128")
  ap.add_argument("--unmasked", action="store_true", help="also time the pre-883519e kernel (GPU only)")
  ap.add_argument("--repeats", type=int, default=1, help="time the gather's variants this many times, alternating")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
  a = ap.parse_args(argv)
  if a.unmasked and INTERPRET:
    ap.error("--unmasked times the pre-883519e kernel, which only a GPU runs")
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
               for c in cfgs},
            **{f"unmasked_{c.block_rows}x{c.block_d}": (lambda x, src, c=c: unmasked_gather(x, src, c))
               for c in (cfgs if a.unmasked else [])}}, ("x", "src_tok")),
        "combine buf->y": ((T * k + T) * d * b, {
            "xla": jax.jit(lambda buf, rows, w: permute._combine(buf, rows, w).astype(jnp.bfloat16))},
            ("buf", "rows", "w")),
        "dx = sum_j dbuf[rows]": ((T * k + T) * d * b, {
            "xla": jax.jit(lambda buf, rows: permute._gather_rows_bwd((rows, T), buf)[0])},
            ("buf", "rows")),
        "combine bwd (dbuf, dc)": ((3 * R + T) * d * b, {
            "xla": jax.jit(lambda buf, rows, w, src, dy: permute._scatter_rows_bwd(jnp.bfloat16, (buf, rows, w, src), dy)[::2])},
            ("buf", "rows", "w", "src_slot", "dy")),
    }
    args_of = lambda names: [v[n] for n in names]
    for move, (nbytes, variants, names) in moves.items():
      want = None
      reps = a.repeats if move.startswith("gather") else 1
      for label, fn in [(f"{lb}" + (f" #{i + 1}" if reps > 1 else ""), f) for i in range(reps)
                        for lb, f in variants.items()]:
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
  return out


if __name__ == "__main__":
  main()
