"""decode_attention_out's one grid against decode_attention + skinny_matmul, in a chain at medium's shapes.

The library's form of probe_overlap_phases.py's one grid (sparsejax.kernels.decode_attention_out): the decode
attention's chunk programs, then W_o's programs, which load their weight slab, wait on a counter for every chunk,
merge their heads' chunks and write their part of o W_o. Shapes are medium-moe's at batch 1: 16 heads of 64,
d 1,024, a 160-slot cache read up to slot 140. Each chain runs steps x layers calls through distinct caches and
weights, the output halved and fed to the next call (chain_timing.py). Variants: the two kernels the decode step
ran before (two_kernels), and the one grid at 4 and 8 warps, its merge reading the chunks with plain loads after
the wait's acquiring atomic or with volatile (system-scope) loads.

GPU:  python experiments/probe_attention_out.py [--layers 24 --steps 100 --rounds 7] [--trace DIR]
CPU:  the same command checks every variant against the reference in interpret mode.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax.kernels.decode_attention import decode_attention
from sparsejax.kernels.decode_attention_out import op as out_op
from sparsejax.kernels.decode_attention_out import triton as out_triton
from sparsejax.kernels.skinny_matmul import skinny_matmul

import chain_timing

H, DH, SLOTS, INDEX = 16, 64, 160, 140
D = H * DH
VARIANTS = {"rk128_w4_2d": (128, 4, False, "2d"), "rk128_w4_nowait": (128, 4, False, "nowait"),
            "rk128_w4_nosync": (128, 4, False, "nosync"), "rk128_w4_attn_only": (128, 4, False, "attn_only"),
            "rk128_w4_wo_only": (128, 4, False, "wo_only"), "rk128_w2_wo_only": (128, 2, False, "wo_only"),
            "rk128_w2_attn_only": (128, 2, False, "attn_only")}
WRONG = ("nowait", "nomerge", "nosync", "attn_only", "wo_only")  # timing-only variants


def _inputs(key, layers):
  ks = jax.random.split(key, 2 * layers + 1)
  x = jax.random.normal(ks[0], (1, D), jnp.float32).astype(jnp.bfloat16)
  caches = [(jax.random.normal(ks[1 + l], (2, 1, SLOTS, H, DH), jnp.float32) / 2).astype(jnp.bfloat16)
            for l in range(layers)]
  wos = [(jax.random.normal(ks[1 + layers + l], (D, D), jnp.float32) / 32).astype(jnp.bfloat16) for l in range(layers)]
  return x, caches, wos


def _finish(x, y):
  rnd = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)
  return (x.astype(jnp.float32) + rnd(y)).astype(jnp.bfloat16)


_START, _IDX = jnp.zeros((1,), jnp.int32), jnp.int32(INDEX)


def two_kernels(x, kv, w_o, cnt, *, interpret=False):
  impl = "triton" if interpret else "auto"
  o = decode_attention(x.reshape(1, H, DH), kv[0], kv[1], _START, _IDX, impl=impl)
  return _finish(x, skinny_matmul(o.reshape(1, D), w_o, impl=impl)), cnt


def one_grid(x, kv, w_o, cnt, *, rk, num_warps, volatile, variant="full", interpret=False):
  bn = out_triton.tiles(H, DH, D)[1]
  parts, cnt = out_triton.attention_out_parts(x.reshape(1, H, DH), kv[0], kv[1], _START, _IDX, w_o.reshape(H, DH, D),
                                              cnt, rk, bn, num_warps, volatile, variant, interpret=interpret)
  return _finish(x, parts.sum(axis=0, keepdims=True)), cnt


def check(interpret: bool) -> dict:
  """Largest |out - reference| of each form over three calls on one counter (inf if the counter is not back at 0)."""
  x, (kv,), (w_o,) = _inputs(jax.random.key(0), 1)
  y, _ = out_op._reference(x.reshape(1, H, DH), kv[0], kv[1], _START, _IDX, w_o, None)
  want = _finish(x, y).astype(jnp.float32)
  forms = {"two_kernels": two_kernels}
  forms.update({n: functools.partial(one_grid, rk=r, num_warps=w, volatile=v, variant=t)
                for n, (r, w, v, t) in VARIANTS.items()
                if t not in WRONG})
  errs = {}
  for name, form in forms.items():
    cnt, err = jnp.zeros((2,), jnp.int32), 0.0
    for _ in range(3):
      out, cnt = form(x, kv, w_o, cnt, interpret=interpret)
      e = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
      e = e if np.isfinite(e) and not np.any(np.asarray(cnt)) else float("inf")
      err = e if not np.isfinite(e) else max(err, e)  # max() would drop a NaN
    errs[name] = err
  return errs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  chain_timing.add_chain_args(ap)
  args = ap.parse_args(argv)
  errs, on_gpu = chain_timing.run_check(check, "max |out - reference| over three calls", width=24)
  if not on_gpu:
    return errs
  L = args.layers
  x0, caches, wos = _inputs(jax.random.key(1), L)

  def chain(x, caches, wos, *, layer):
    def body(_, carry):
      x, cnts = carry
      out = []
      for l in range(L):
        x, cnt = layer(x, caches[l], wos[l], cnts[l])
        x = chain_timing.halve(x)
        out.append(cnt)
      return x, out
    return jax.lax.fori_loop(0, args.steps, body, (x, [jnp.zeros((2,), jnp.int32)] * L))[0]

  fns = {"two_kernels": jax.jit(functools.partial(chain, layer=two_kernels))}
  for name, (r, w, v, t) in VARIANTS.items():
    layer = functools.partial(one_grid, rk=r, num_warps=w, volatile=v, variant=t)
    fns[name] = jax.jit(functools.partial(chain, layer=layer))
  args_of = dict.fromkeys(fns, (x0, caches, wos))
  chain_timing.compare_outputs(fns, args_of, "two_kernels", f"chain of {args.steps} x {L}",
                               skip=lambda n: n.endswith(WRONG))
  times = chain_timing.time_interleaved(fns, args_of, args.rounds, args.steps * L)
  chain_timing.print_times(times, "two_kernels", "a layer")
  if args.trace:
    chain_timing.print_trace(fns, args_of, args.trace, args.steps * L, "a layer")
  return times


if __name__ == "__main__":
  main()
