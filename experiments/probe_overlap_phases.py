"""Does a product's weight stream for free while a small latency-bound phase runs, if both are ONE kernel?

A medium-moe decode layer is 11 dependent kernels, and each costs a fixed ~2-4 us whatever it reads
(experiments/probe_tma_read.py). The twenty-fourth session's one-kernel FFN handed W_in's output to W_out's
programs through counters and tied the two kernels: W_in's 512 programs filled the GPU, so W_out's programs
started only as they retired, and their early weight loads overlapped nothing. Here the first phase is
small, as the attention is: 64 programs (16 heads x 4 chunks) that each read 32 KB and run a dependent chain
of two reductions. The W_o product's 32 programs (64 KB of W_o each) fit beside them, so in one grid they can
load their weights while the attention runs, then wait on a counter for its parts:

  o[h] = round(sum_c o_{h,c}),  o_{h,c} = kv[h,c]^T (kv[h,c] q_h) / R      (q = x, split into heads)
  y = round(x + round(o W_o))                                             (bf16, one row)

  three_kernels   the attention-like kernel, XLA's merge of the chunks, skinny_matmul (W_o) and XLA's residual
  one_kernel      one grid: the attention programs, then W_o's programs (weights loaded, then the wait)
  one_kernel_late the same, W_o's weights loaded only after the wait (what the overlap is worth)

Counters are never reset (probe_dataflow_ffn.py's scheme: call `epoch` waits for (epoch + 1) x 64 arrivals;
interpret mode runs the programs in order, so the CPU checks the kernel).

Measured on an H100 (experiments/results/decode_overlap_phases_H100.log): three_kernels 9.79 us a layer,
one_kernel 7.72, one_kernel_w8 6.91 (0.71x), one_kernel_late 8.06; traced, the one grid at 8 warps took 5.58
us of device time against 5.06 + 1.17 + 2.78 for the three. The library's form (decode_attention's chunk programs,
then W_o's; commit 0725258, reverted) ran 1.39-1.58x slower than its two kernels as first built, with the chunk
merge a load per head (results/decode_attention_out_chain_H100.log). Three later forms (commits 609b850, aba8360,
17789d5) ran at 0.99-1.45x at bench_decode's cache and were reverted: notes_decode.md, twenty-sixth session. The
logs were measured before the CTA barrier ahead of the counting atomic was added (notes_decode.md: a latent race).

GPU:  python experiments/probe_overlap_phases.py [--layers 24 --steps 100 --rounds 7]
CPU:  the same command checks every variant in interpret mode.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from sparsejax.kernels.skinny_matmul import skinny_matmul

import chain_timing

H, DH, C, R = 16, 64, 4, 256      # heads, head dim, chunks a head, rows a chunk (32 KB a program)
D = H * DH                        # 1,024: medium's d
NA = H * C                        # attention-like programs: a power of two (the counter's wrap)
BN, RK = 64, 512                  # W_o programs: 64 columns by 512 rows (64 KB)
NB = (D // BN) * (D // RK)
VARIANTS = {"one_kernel": (True, 4), "one_kernel_w8": (True, 8), "one_kernel_late": (False, 4)}


def _attend(x_ref, kv_ref, h, c):
  """o_{h,c} [DH] float32."""
  f32 = lambda v: v.astype(jnp.float32)
  q = f32(x_ref[0, pl.ds(pl.multiple_of(h * DH, DH), DH)])
  kv = f32(kv_ref[h, c])
  s = jnp.sum(kv * q[None, :], axis=1)
  return jnp.sum(kv * s[:, None], axis=0) * (1.0 / R)


def _attention_kernel(x_ref, kv_ref, parts_ref):
  i = pl.program_id(0)
  h, c = i // C, i % C
  parts_ref[c, pl.ds(pl.multiple_of(h * DH, DH), DH)] = _attend(x_ref, kv_ref, h, c)


def attention_parts(x, kv, *, interpret=False):
  """[C, D] float32: every chunk's o_{h,c}, a kernel of its own."""
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=4, num_stages=1)
  return pl.pallas_call(_attention_kernel, grid=(NA,), in_specs=[pl.no_block_spec] * 2,
                        out_specs=pl.no_block_spec, out_shape=jax.ShapeDtypeStruct((C, D), jnp.float32),
                        interpret=interpret, compiler_params=params, name="probe_attention")(x, kv)


def _one_kernel(x_ref, kv_ref, wo_ref, epoch_ref, _, y_ref, parts_ref, cnt_ref, *, early, interpret):
  from jax.experimental.pallas import triton as plt
  vid = pl.program_id(0)
  one, zero = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32) + vid * 0
  f32 = lambda v: v.astype(jnp.float32)
  load = (lambda r: r[...]) if interpret else (lambda r: plt.load(r, volatile=True))
  # Triton's scalar atomic is one thread's: without a CTA barrier the other threads' stores need not be visible
  # when it releases (found in the SASS after the GPU runs, which were measured without it).
  barrier = (lambda: None) if interpret else plt.debug_barrier

  @pl.when(vid < NA)
  def _attention():
    h, c = vid // C, vid % C
    parts_ref[c, pl.ds(pl.multiple_of(h * DH, DH), DH)] = _attend(x_ref, kv_ref, h, c)
    barrier()  # every thread's stores of the part, then one thread's release
    plt.atomic_add(cnt_ref, (zero,), one)  # acquire-release: the part is visible first

  @pl.when(vid >= NA)
  def _w_o():
    j, p = (vid - NA) // (D // RK), (vid - NA) % (D // RK)
    cols = pl.ds(pl.multiple_of(j * BN, BN), BN)
    ks = pl.ds(pl.multiple_of(p * RK, RK), RK)
    w = wo_ref[ks, cols] if early else None
    target = (epoch_ref[0] + 1) * NA
    cap = 1 if interpret else 2 ** 30  # interpret mode: every arrival is in already (programs in order)
    jax.lax.while_loop(lambda s: (s[0] - target < 0) & (s[1] <= cap),
                       lambda s: (plt.atomic_add(cnt_ref, (zero,), zero), s[1] + 1), (target - 1, zero))
    o = load(parts_ref.at[0, ks])
    for c in range(1, C):
      o = o + load(parts_ref.at[c, ks])
    o = o.astype(jnp.bfloat16).astype(jnp.float32)
    w = wo_ref[ks, cols] if w is None else w
    y_ref[p, cols] = jnp.sum(o[:, None] * f32(w), axis=0)


@functools.partial(jax.jit, static_argnames=("early", "num_warps", "interpret"))
def one_kernel_parts(x, kv, w_o, epoch, cnt, *, early=True, num_warps=4, interpret=False):
  """([D // RK, D] float32 parts of o W_o, the counter after the call)."""
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
  y, _, cnt = pl.pallas_call(
      functools.partial(_one_kernel, early=early, interpret=interpret), grid=(NA + NB,),
      in_specs=[pl.no_block_spec] * 5, out_specs=[pl.no_block_spec] * 3,
      out_shape=[jax.ShapeDtypeStruct((D // RK, D), jnp.float32), jax.ShapeDtypeStruct((C, D), jnp.float32),
                 jax.ShapeDtypeStruct((1,), jnp.int32)],
      input_output_aliases={4: 2}, interpret=interpret, compiler_params=params, name="probe_one_kernel",
  )(x, kv, w_o, jnp.reshape(epoch, (1,)).astype(jnp.int32), cnt)
  return y, cnt


def _finish(x, y):
  rnd = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)
  return (x.astype(jnp.float32) + rnd(y)).astype(jnp.bfloat16)


def three_kernels(x, kv, w_o, *, interpret=False):
  o = attention_parts(x, kv, interpret=interpret).sum(axis=0, keepdims=True).astype(jnp.bfloat16)
  return _finish(x, skinny_matmul(o, w_o, impl="triton" if interpret else "auto"))


def one_kernel(x, kv, w_o, epoch, cnt, **kw):
  y, cnt = one_kernel_parts(x, kv, w_o, epoch, cnt, **kw)
  return _finish(x, y.sum(axis=0, keepdims=True)), cnt


def reference(x, kv, w_o):
  f32 = lambda v: v.astype(jnp.float32)
  q = f32(x[0]).reshape(H, 1, 1, DH)
  s = jnp.sum(f32(kv) * q, axis=-1, keepdims=True)
  o = (jnp.sum(f32(kv) * s, axis=2) / R).sum(axis=1).reshape(1, D)
  y = jnp.dot(o.astype(jnp.bfloat16).astype(jnp.float32), f32(w_o), precision="highest")
  return _finish(x, y)


def _inputs(key, layers):
  ks = jax.random.split(key, 2 * layers + 1)
  x = jax.random.normal(ks[0], (1, D), jnp.float32).astype(jnp.bfloat16)
  # o ~ C var(kv) q: about x itself, and y about as large, so a wrong part moves the output by many ulps
  kvs = [(jax.random.normal(ks[1 + l], (H, C, R, DH), jnp.float32) / 2).astype(jnp.bfloat16) for l in range(layers)]
  wos = [(jax.random.normal(ks[1 + layers + l], (D, D), jnp.float32) / 32).astype(jnp.bfloat16)
         for l in range(layers)]
  return x, kvs, wos


def check(interpret: bool) -> dict:
  """Largest |out - reference| of each form over three calls on one counter and one across its int32 wrap."""
  x, (kv,), (w_o,) = _inputs(jax.random.key(0), 1)
  want = reference(x, kv, w_o).astype(jnp.float32)
  errs = {"three_kernels": float(jnp.max(jnp.abs(three_kernels(x, kv, w_o, interpret=interpret) - want)))}
  for name, (early, warps) in VARIANTS.items():
    cnt, err = jnp.zeros((1,), jnp.int32), 0.0
    for epoch in (0, 1, 2, None):
      if epoch is None:  # just short of int32's wrap: this call's arrivals cross it
        epoch = (2 ** 31 - 1) // NA
        cnt = jnp.full((1,), epoch * NA, jnp.int32)
      out, cnt = one_kernel(x, kv, w_o, jnp.int32(epoch), cnt, early=early, num_warps=warps, interpret=interpret)
      e = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
      # The count the next call waits for. (Interpret mode cannot test the wait itself: its programs run in
      # order, so every arrival is in before any W_o program looks; the GPU run compares 2,400 calls instead.)
      if int(cnt[0]) != int(np.int64((epoch + 1) * NA).astype(np.int32)):  # int32 wraps alike
        e = float("inf")
      err = max(err, e) if np.isfinite(e) else float("inf")  # max() would drop a NaN
    errs[name] = err
  return errs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  chain_timing.add_chain_args(ap)
  args = ap.parse_args(argv)
  errs, on_gpu = chain_timing.run_check(check, "max |out - reference| over its calls", width=16)
  if not on_gpu:
    return errs
  L = args.layers
  x0, kvs, wos = _inputs(jax.random.key(1), L)
  halve = chain_timing.halve

  def chain_three(x, kvs, wos):
    def body(_, x):
      for l in range(L):
        x = halve(three_kernels(x, kvs[l], wos[l]))
      return x
    return jax.lax.fori_loop(0, args.steps, body, x)

  def chain_one(x, kvs, wos, *, early, num_warps):
    def body(step, carry):
      x, cnts = carry
      out = []
      for l in range(L):
        x, cnt = one_kernel(x, kvs[l], wos[l], step, cnts[l], early=early, num_warps=num_warps)
        x = halve(x)
        out.append(cnt)
      return x, out
    return jax.lax.fori_loop(0, args.steps, body, (x, [jnp.zeros((1,), jnp.int32)] * L))[0]

  fns = {"three_kernels": jax.jit(chain_three)}
  for name, (early, warps) in VARIANTS.items():
    fns[name] = jax.jit(functools.partial(chain_one, early=early, num_warps=warps))
  args_of = dict.fromkeys(fns, (x0, kvs, wos))
  chain_timing.compare_outputs(fns, args_of, "three_kernels", f"chain of {args.steps} x {L}", width=16)
  times = chain_timing.time_interleaved(fns, args_of, args.rounds, args.steps * L)
  chain_timing.print_times(times, "three_kernels", "a layer", width=16)
  if args.trace:
    chain_timing.print_trace(fns, args_of, args.trace, args.steps * L, "a layer")
  return times


if __name__ == "__main__":
  main()
