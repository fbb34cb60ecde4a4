"""decode_attention's kernel configs at batch 1 and 32 against the kernel before (--old), chained over a model's layers.

At batch 32 the medium-MoE step's attention took 25.6 us a layer on an H200 and the merge after it 7.7, for about 58 MB
of cache a layer (14 us at the copy bandwidth; results/decode_H200_s44_b32_trace_stdout.log). The kernel gave each
64-slot chunk a program. Here each config of the split kernel (a program per row, head and split, looping over its
chunks; one split normalizes in the kernel and needs no merge) runs as a chain of `layers` calls through distinct
caches (as a step's layers; each output feeds the next query), timed interleaved with the others, its first call's
output checked against the float32 reference. The cache has --slots slots, the query sits in --index, as
bench_decode's timed steps do on average (585 slots, 441 filled).

  python experiments/probe_decode_attention.py --old path/to/old_triton.py      # GPU
  python experiments/probe_decode_attention.py --smoke                         # any backend: a small case
  python experiments/probe_decode_attention.py --focused --presets medium-moe --batches 32 --slots 4096 \
      --index 3500 --stages 1,2,3                                             # GPU: the chunk loop pipelined
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from chain_timing import time_interleaved  # noqa: E402
from sparsejax.kernels.decode_attention import decode_attention_reference, op, triton  # noqa: E402
from sparsejax.models.config import PRESETS  # noqa: E402


def load_old(path: str):
  spec = importlib.util.spec_from_file_location("old_decode_attention_triton", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return lambda q, k, v, s, i: op._merge(*mod.chunk_attention(q, k, v, s, i, interpret=False), q.dtype)


def _name(c: triton.Config) -> str:
  return (f"c{c.chunk}_s{c.splits}_w{c.num_warps}" + ("_dyn" if c.dynamic_loop else "")
          + (f"_st{c.num_stages}" if c.num_stages != 1 else ""))


def focused(b: int, h: int, slots: int, stages=(1,)) -> dict[str, triton.Config]:
  """The default config, and it with half and twice the splits, 2 and 4 warps, the static loop, each of stages."""
  d = triton.default_config(b, h, slots)
  chunks = -(-slots // d.chunk)
  out = [dataclasses.replace(d, splits=splits, num_warps=warps, dynamic_loop=dynamic, num_stages=st)
         for splits, warps, dynamic, st in itertools.product(
             sorted({max(1, d.splits // 2), d.splits, min(chunks, 2 * d.splits)}), (2, 4), (False, True), stages)]
  return {_name(c): c for c in out}


def configs(b: int, h: int, slots: int, stages=(1,)) -> dict[str, triton.Config]:
  chunks64 = -(-slots // 64)
  out = []
  splits_set = sorted({1, 2, 4, chunks64} if b * h >= 128 else {chunks64, max(1, chunks64 // 2), 2 * chunks64})
  for chunk, splits, warps, dynamic, st in itertools.product((32, 64, 128), splits_set, (2, 4), (False, True), stages):
    chunk = triton.chunk_size(slots, chunk)
    if splits <= -(-slots // chunk):
      out.append(triton.Config(chunk=chunk, splits=splits, num_warps=warps, dynamic_loop=dynamic, num_stages=st))
  return {_name(c): c for c in out}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--old", help="the kernel file before the split form (its chunk_attention)")
  ap.add_argument("--presets", default="medium-moe,small-moe,xs-moe")
  ap.add_argument("--batches", default="1,32")
  ap.add_argument("--slots", type=int, default=585)
  ap.add_argument("--index", type=int, default=441)
  ap.add_argument("--steps", type=int, default=10, help="passes over the layers in one timed call")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--top", type=int, default=8, help="configs printed per case, fastest first")
  ap.add_argument("--focused", action="store_true", help="only the default config and its neighbours")
  ap.add_argument("--stages", default="1", help="Triton pipeline stages to try, e.g. 1,2,3 (num_stages of the "
                  "chunk loop; 2 or more has Triton load the next chunk while this one is reduced)")
  ap.add_argument("--smoke", action="store_true")
  args = ap.parse_args(argv)
  try:
    stages = tuple(int(n) for n in args.stages.split(","))
  except ValueError:
    stages = ()
  if not stages or min(stages) < 1:
    raise SystemExit(f"--stages {args.stages!r}: expected positive integers, e.g. 1,2,3")
  if args.smoke:
    args.presets, args.batches, args.slots, args.index, args.steps, args.rounds = "tiny-moe", "1,8", 100, 70, 1, 1
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  rng = np.random.default_rng(0)
  report = {}
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; slots {args.slots}, query in slot {args.index}")
  for preset, b in itertools.product(args.presets.split(","), map(int, args.batches.split(","))):
    cfg = PRESETS[preset]
    h, dh, layers = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.num_layers
    if args.smoke:  # one layer's cache: a smoke run's times mean nothing, and each layer is another kernel to compile
      layers = 1
    keys = iter(jax.random.split(jax.random.key(b), 2 * layers + 1))
    draw = lambda *s: jax.random.normal(next(keys), s, dtype)  # on the device: a host draw of 4,096 slots takes minutes
    ks = [draw(b, args.slots, h, dh) for _ in range(layers)]
    vs = [draw(b, args.slots, h, dh) for _ in range(layers)]
    q0 = draw(b, h, dh)
    start = jnp.asarray(rng.integers(0, 40, b) * (np.arange(b) % 3 == 1), jnp.int32)  # a third of the rows padded
    index = jnp.int32(args.index)
    fns = {"library": op._kernel}
    if args.old:
      fns["old"] = load_old(args.old)
    for name, c in (focused if args.focused else configs)(b, h, args.slots, stages).items():
      fns[name] = lambda q, k, v, s, i, c=c: op._split_kernel(q, k, v, s, i, c)
    want = np.asarray(decode_attention_reference(q0, ks[0], vs[0], start, index), np.float32)
    chains, errs = {}, {}
    for name, f in fns.items():
      try:
        errs[name] = float(np.max(np.abs(np.asarray(jax.jit(f)(q0, ks[0], vs[0], start, index), np.float32) - want)))
      except Exception as e:  # a config Triton cannot compile is reported, not fatal
        print(f"  {preset} b{b} {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        continue

      def chain(q, ks, vs, f=f):
        def one(_, q):
          for k, v in zip(ks, vs):
            q = (f(q, k, v, start, index).astype(jnp.float32) * 4).astype(q.dtype)
          return q
        return jax.lax.fori_loop(0, args.steps, one, q)
      chains[name] = jax.jit(chain)
    arg = (q0, ks, vs)
    for g in chains.values():
      jax.block_until_ready(g(*arg))
    times = time_interleaved(chains, {n: arg for n in chains}, args.rounds, args.steps * layers)
    seen = b * (args.index + 1) - int(jnp.sum(jnp.minimum(start, args.index)))
    mb = 2 * seen * h * dh * jnp.dtype(dtype).itemsize / 1e6
    print(f"\n{preset} batch {b}: {h} heads of {dh}, {layers} layers, {mb:.1f} MB of visible cache a layer")
    base = np.median(times["old" if "old" in times else "library"])
    rows = sorted(times, key=lambda n: np.median(times[n]))
    shown = [n for n in rows[:args.top]] + [n for n in ("library", "old") if n in times and n not in rows[:args.top]]
    for n in shown:
      t = np.median(times[n])
      print(f"  {n:<22} {t:7.2f} us a layer ({min(times[n]):.2f}-{max(times[n]):.2f}), {mb / t:5.2f} TB/s, "
            f"{t / base:.3f}x {'old' if 'old' in times else 'library'}, max err {errs[n]:.2g}")
    worst = max(errs.values())
    print(f"  every config's largest error: {worst:.2g} ({len(errs)} variants)")
    report[f"{preset}_b{b}"] = dict(errs=errs, us={n: float(np.median(t)) for n, t in times.items()}, megabytes=mb)
  return report


if __name__ == "__main__":
  main()
