"""decode_attention_out's one kernel against decode_attention + skinny_matmul, in a chain at medium's shapes.

The library's kernel (sparsejax.kernels.decode_attention_out): program (h, j) runs head h's attention over the
whole cache, then multiplies o_h by its W_o slab (rows of head h, bn columns); the caller sums the heads' parts.
Shapes are medium-moe's at batch 1: 16 heads of 64, d 1,024, a cache of --slots slots (160: bench_decode's
128-token prompt and 32 new tokens) read up to slot --index. Each chain runs steps x layers calls through distinct
caches and weights, the output halved and fed to the next call (chain_timing.py). Variants: the two kernels the
decode step runs without it (two_kernels), and the one kernel at bn columns a program and num_warps warps.

The counter form it replaced (decode_attention's chunk programs, then W_o's programs waiting on a counter; commit
609b850) was measured with this probe at that commit: 1.07-1.5x the two kernels (notes_decode.md).

GPU:  python experiments/probe_attention_out.py [--slots 160 --index 140] [--layers 24 --steps 100 --rounds 7]
CPU:  the same command checks every variant against the reference in interpret mode.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax.experimental import pallas as pl

from sparsejax.kernels.decode_attention import decode_attention
from sparsejax.kernels.decode_attention import triton as attention
from sparsejax.kernels.decode_attention_out import op as out_op
from sparsejax.kernels.decode_attention_out import triton as out_triton
from sparsejax.kernels.skinny_matmul import skinny_matmul

import chain_timing

H, DH = 16, 64
D = H * DH
VARIANTS = {"epoch_rk128_w4": (128, 4), "epoch_rk128_w8": (128, 8), "epoch_rk512_w8": (512, 8)}


def _inputs(key, layers, slots):
  ks = jax.random.split(key, 2 * layers + 1)
  x = jax.random.normal(ks[0], (1, D), jnp.float32).astype(jnp.bfloat16)
  caches = [(jax.random.normal(ks[1 + l], (2, 1, slots, H, DH), jnp.float32) / 2).astype(jnp.bfloat16)
            for l in range(layers)]
  wos = [(jax.random.normal(ks[1 + layers + l], (D, D), jnp.float32) / 32).astype(jnp.bfloat16) for l in range(layers)]
  return x, caches, wos


def _finish(x, y):
  rnd = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)
  return (x.astype(jnp.float32) + rnd(y)).astype(jnp.bfloat16)


_START = jnp.zeros((1,), jnp.int32)


def two_kernels(x, kv, w_o, sync, *, index, interpret=False):
  impl = "triton" if interpret else "auto"
  o = decode_attention(x.reshape(1, H, DH), kv[0], kv[1], _START, index, impl=impl)
  return _finish(x, skinny_matmul(o.reshape(1, D), w_o, impl=impl)), sync


def one_kernel(x, kv, w_o, sync, *, index, rk, num_warps, interpret=False):
  bn = out_triton.tiles(H, DH, D)[1]
  parts, cnt, epoch = out_triton.attention_out_parts(x.reshape(1, H, DH), kv[0], kv[1], _START, index,
                                                     w_o.reshape(H, DH, D), *sync, rk, bn, num_warps,
                                                     interpret=interpret)
  return _finish(x, parts.sum(axis=0, keepdims=True)), (cnt, epoch)


_SYNC0 = (jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32))


def forms() -> dict:
  out = {"two_kernels": two_kernels}
  out.update({n: functools.partial(one_kernel, rk=rk, num_warps=w) for n, (rk, w) in VARIANTS.items()})
  return out


def check(interpret: bool, slots: int = 160, index: int = 140) -> dict:
  """Largest |out - reference| of each form over three calls, inf if the counter is not at epoch x arrivals."""
  x, (kv,), (w_o,) = _inputs(jax.random.key(0), 1, slots)
  index = jnp.int32(index)
  y, _ = out_op._reference(x.reshape(1, H, DH), kv[0], kv[1], _START, index, w_o, None)
  want = _finish(x, y).astype(jnp.float32)
  errs = {}
  chunk = attention.chunk_size(slots)
  arrivals = H * pl.next_power_of_2(-(-slots // chunk))  # the attention's programs: one count each a call
  for name, form in forms().items():
    sync, err = _SYNC0, 0.0
    for call in range(1, 4):
      out, sync = form(x, kv, w_o, sync, index=index, interpret=interpret)
      e = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
      if name != "two_kernels" and (int(sync[0][0]), int(sync[1][0])) != (call * arrivals, call):
        e = float("inf")
      err = e if not np.isfinite(e) else max(err, e)  # max() would drop a NaN
    errs[name] = err
  return errs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  chain_timing.add_chain_args(ap)
  ap.add_argument("--slots", type=int, default=160, help="cache slots")
  ap.add_argument("--index", type=int, default=140, help="the query's slot")
  args = ap.parse_args(argv)
  errs, on_gpu = chain_timing.run_check(functools.partial(check, slots=args.slots, index=args.index),
                                        "max |out - reference|")
  if not on_gpu:
    return errs
  L, index = args.layers, jnp.int32(args.index)
  x0, caches, wos = _inputs(jax.random.key(1), L, args.slots)

  def chain(x, caches, wos, *, layer):
    def body(_, carry):
      x, syncs = carry
      out = []
      for l in range(L):
        x, sync = layer(x, caches[l], wos[l], syncs[l], index=index)
        x = chain_timing.halve(x)
        out.append(sync)
      return x, out
    return jax.lax.fori_loop(0, args.steps, body, (x, [_SYNC0] * L))[0]

  fns = {n: jax.jit(functools.partial(chain, layer=f)) for n, f in forms().items()}
  args_of = dict.fromkeys(fns, (x0, caches, wos))
  chain_timing.compare_outputs(fns, args_of, "two_kernels", f"chain of {args.steps} x {L}")
  times = chain_timing.time_interleaved(fns, args_of, args.rounds, args.steps * L)
  chain_timing.print_times(times, "two_kernels", "a layer")
  if args.trace:
    chain_timing.print_trace(fns, args_of, args.trace, args.steps * L, "a layer")
  return times


if __name__ == "__main__":
  main()
