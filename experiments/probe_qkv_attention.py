"""decode_qkv_attention's one kernel against decode_qkv + decode_attention, in a chain at medium's shapes.

Each call is a decode layer's front at batch 1: the qkv product's split-K parts (skinny_matmul.split_k_parts,
the same in every variant), then either decode_qkv (the parts' sum, RoPE, the cache write) and decode_attention's
chunk kernel, or the one kernel that does both; then the chunks' merge and a residual add. Shapes are medium-moe's:
d 1,024, 16 heads of 64, a cache of --slots slots (585: bench_decode's) written and read at slot --index (441:
the mean slot of bench_decode's timed steps). Each chain runs steps x layers calls through distinct weights and
caches (chain_timing.py); the caches are the loop's carry, written in place.

GPU:  python experiments/probe_qkv_attention.py [--slots 585 --index 441] [--layers 24 --steps 100 --rounds 7]
CPU:  the same command checks every variant against the reference in interpret mode.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparsejax.kernels.decode_attention import op as attention_op
from sparsejax.kernels.decode_attention import triton as attention_triton
from sparsejax.kernels.decode_qkv import decode_qkv_reference
from sparsejax.kernels.decode_qkv import triton as qkv_triton
from sparsejax.kernels.decode_qkv_attention import triton as fused_triton
from sparsejax.kernels.decode_attention import decode_attention_reference
from sparsejax.kernels.skinny_matmul import split_k_parts
from sparsejax.rope import inverse_frequencies

import chain_timing

H, DH = 16, 64
D = H * DH
BASE = 10_000.0
VARIANTS = {"one_kernel_w2": 2, "one_kernel_w4": 4}
_START = jnp.zeros((1,), jnp.int32)


def _inputs(key, layers, slots):
  ks = jax.random.split(key, 2 * layers + 1)
  x = jax.random.normal(ks[0], (1, D), jnp.float32).astype(jnp.bfloat16)
  caches = [(jax.random.normal(ks[1 + l], (2, 1, slots, H, DH), jnp.float32) / 2).astype(jnp.bfloat16)
            for l in range(layers)]
  ws = [(jax.random.normal(ks[1 + layers + l], (D, 3 * D), jnp.float32) / 32).astype(jnp.bfloat16)
        for l in range(layers)]
  return x, caches, ws


def _finish(x, o):
  return (x.astype(jnp.float32) + o.reshape(1, D).astype(jnp.float32)).astype(jnp.bfloat16)


def two_kernels(x, kv, w, *, index, interpret=False):
  parts = split_k_parts(x, w, impl="triton" if interpret else "auto")
  inv = inverse_frequencies(DH, BASE)
  q, k, v = qkv_triton.decode_qkv(parts, kv[0], kv[1], index, _START, inv, jnp.dtype(jnp.bfloat16),
                                  interpret=interpret)
  part, stats = attention_triton.chunk_attention(q, k, v, _START, index, interpret=interpret)
  return _finish(x, attention_op.merge_chunks(part, stats, jnp.bfloat16)), jnp.stack([k, v])


def one_kernel(x, kv, w, *, index, num_warps, interpret=False):
  parts = split_k_parts(x, w, impl="triton" if interpret else "auto")
  inv = inverse_frequencies(DH, BASE)
  part, stats, k, v = fused_triton.qkv_chunk_attention(parts, kv[0], kv[1], index, _START, inv,
                                                       jnp.dtype(jnp.bfloat16), num_warps, interpret=interpret)
  return _finish(x, attention_op.merge_chunks(part, stats, jnp.bfloat16)), jnp.stack([k, v])


def forms() -> dict:
  out = {"two_kernels": two_kernels}
  out.update({n: functools.partial(one_kernel, num_warps=w) for n, w in VARIANTS.items()})
  return out


def check(interpret: bool, slots: int = 585, index: int = 441) -> dict:
  """Largest |out - reference| of each form, and of its caches against the reference's."""
  x, (kv,), (w,) = _inputs(jax.random.key(0), 1, slots)
  index = jnp.int32(index)
  parts = split_k_parts(x, w, impl="triton" if interpret else "auto")
  q, k, v = decode_qkv_reference(parts, kv[0], kv[1], index, _START, BASE, jnp.bfloat16)
  want = _finish(x, decode_attention_reference(q, k, v, _START, index)).astype(jnp.float32)
  errs = {}
  for name, form in forms().items():
    out, kv_out = form(x, kv, w, index=index, interpret=interpret)
    err = max(float(jnp.max(jnp.abs(out.astype(jnp.float32) - want))),
              float(jnp.max(jnp.abs(kv_out.astype(jnp.float32) - jnp.stack([k, v]).astype(jnp.float32)))))
    errs[name] = err if np.isfinite(err) else float("inf")
  return errs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  chain_timing.add_chain_args(ap)
  ap.add_argument("--slots", type=int, default=585, help="cache slots")
  ap.add_argument("--index", type=int, default=441, help="the new token's slot")
  args = ap.parse_args(argv)
  errs, on_gpu = chain_timing.run_check(functools.partial(check, slots=args.slots, index=args.index),
                                        "max |out or caches - reference|")
  if not on_gpu:
    return errs
  L, index = args.layers, jnp.int32(args.index)
  x0, caches, ws = _inputs(jax.random.key(1), L, args.slots)

  def chain(x, caches, ws, *, layer):
    def body(_, carry):
      x, caches = carry
      out = []
      for l in range(L):
        x, kv = layer(x, caches[l], ws[l], index=index)
        x = chain_timing.halve(x)
        out.append(kv)
      return x, out
    return jax.lax.fori_loop(0, args.steps, body, (x, list(caches)))[0]

  fns = {n: jax.jit(functools.partial(chain, layer=f)) for n, f in forms().items()}
  args_of = dict.fromkeys(fns, (x0, caches, ws))
  chain_timing.compare_outputs(fns, args_of, "two_kernels", f"chain of {args.steps} x {L}")
  times = chain_timing.time_interleaved(fns, args_of, args.rounds, args.steps * L)
  chain_timing.print_times(times, "two_kernels", "a layer")
  if args.trace:
    chain_timing.print_trace(fns, args_of, args.trace, args.steps * L, "a layer")
  return times


if __name__ == "__main__":
  main()
