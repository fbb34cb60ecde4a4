"""Is a decode feed-forward faster as ONE kernel whose programs hand the hidden layer forward through counters?

At batch 1 a medium-moe layer's expert FFN is two one-wave Pallas Triton kernels (skinny_ffn: W_in's split-K
parts, then W_out's programs summing them with the activation as they load) and an XLA fusion for the combine
weight and the residual. Each kernel pays its ramp and its tail before the next one's weight bytes flow. This
probe runs the same FFN as one grid of programs in two groups, in program order:

  W_in programs   (column block j of f, split p of d): store the float32 part x[p] W_in[e][p, j], then count
                  themselves in on the counter of the W_out slab their columns belong to.
  W_out programs  (column block of d, split q of f): issue their weight slab's loads first, then wait until
                  every W_in program of slab q has counted in; sum the parts, act, round, multiply, store their
                  part; the last program of a column block (a second counter) sums the parts, scales by the
                  combine weight and adds the residual.

A program waits only on programs with lower ids, so nothing needs all programs resident: the GPU starts
programs in id order (the same forward-progress argument as a decoupled look-back scan), and interpret mode
runs them in order, so the kernel is checked on the CPU. The counters are never reset: call `epoch` of a
counter buffer waits for (epoch + 1) x (programs per slab) arrivals (int32 arithmetic wraps consistently,
since every count a call adds is a power of two), so the buffer is threaded through the decode loop like a
KV cache and needs no memset; "fresh" instead hands each call a zeroed buffer (epoch 0).

  y = resid + round(c * round(h W_out[e]))     h = round(act(round(x W_in[e])))     (bf16, top-1, one row)

Measured on an H100 (experiments/results/decode_dataflow_ffn_H100.log), at medium-moe's d 1,024, f 4,096: the
one kernel at best ties the two kernels it replaces (12.66 against 12.57 us a layer), with fresh counters it is
11% slower, with tensor-core dots 10-54% slower; see experiments/notes_decode.md.

The logs were measured before the CTA barriers ahead of the counting atomics were added (notes_decode.md,
twenty-fifth session: a latent race that the GPU runs did not hit).

GPU:  python experiments/probe_dataflow_ffn.py [--layers 24 --steps 100 --rounds 7]
CPU:  the same command checks every variant in interpret mode at small sizes (and the counters' wrap-around).
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from sparsejax.activations import PLAIN
from sparsejax.kernels.skinny_matmul import skinny_ffn

import chain_timing

BN1 = 64              # W_in: columns of f a program
BN2, R2 = 64, 512     # W_out: columns of d, rows of f a program
# name: (rows of d a W_in program, tensor-core dots, warps, fresh counters each call)
VARIANTS = {
    "dataflow_r512_w4": (512, False, 4, False),
    "dataflow_r512_w4_fresh": (512, False, 4, True),
    "dataflow_r512_w8": (512, False, 8, False),
    "dataflow_r512_w4_dot": (512, True, 4, False),
    "dataflow_r256_w4_dot": (256, True, 4, False),
    "dataflow_r128_w4_dot": (128, True, 4, False),
}


def _row_dot(v, w):
  """v [K] (rounded to w's dtype) times w [K, N] on the tensor cores: v as the first of 16 rows."""
  first = jax.lax.broadcasted_iota(jnp.int32, (16, v.shape[0]), 0) == 0
  a = jnp.where(first, jnp.broadcast_to(v.astype(w.dtype)[None, :], (16, v.shape[0])), jnp.zeros((), w.dtype))
  out = jax.lax.dot_general(a, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  return jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, out.shape, 0) == 0, out, 0.0), axis=0)


def _row_mulsum(v, w):
  return jnp.sum(v[:, None] * w.astype(jnp.float32), axis=0)


def _kernel(ids_ref, c_ref, x_ref, res_ref, win_ref, wout_ref, epoch_ref, _, y_ref, p1_ref, p2_ref, cnt_ref, *,
            act, rows_in, use_dot, interpret):
  from jax.experimental.pallas import triton as plt
  d, f = win_ref.shape[1:]
  s1, s2 = d // rows_in, f // R2
  n1 = (f // BN1) * s1
  per_slab = (R2 // BN1) * s1  # W_in programs whose columns make up one W_out program's rows of h
  vid = pl.program_id(0)
  one, zero = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32) + vid * 0
  e = ids_ref[0]
  product = _row_dot if use_dot else _row_mulsum
  # Other programs' parts: past L1 (volatile), which could hold lines another program on this SM read.
  load = (lambda r: r[...]) if interpret else (lambda r: plt.load(r, volatile=True))
  # Triton's scalar atomic is one thread's: without a CTA barrier the other threads' stores need not be visible
  # when it releases (found in the SASS after the GPU runs, which were measured without it).
  barrier = (lambda: None) if interpret else plt.debug_barrier

  @pl.when(vid < n1)
  def _w_in():
    j, p = vid // s1, vid % s1
    cols = pl.ds(pl.multiple_of(j * BN1, BN1), BN1)
    ks = pl.ds(pl.multiple_of(p * rows_in, rows_in), rows_in)
    p1_ref[p, cols] = product(x_ref[0, ks].astype(jnp.float32), win_ref[e, ks, cols])
    barrier()  # every thread's stores of the part, then one thread's release
    plt.atomic_add(cnt_ref, (1 + (j * BN1) // R2,), one)  # acquire-release: the part is visible first

  @pl.when(vid >= n1)
  def _w_out():
    j2, q = (vid - n1) // s2, (vid - n1) % s2
    cols = pl.ds(pl.multiple_of(j2 * BN2, BN2), BN2)
    ks = pl.ds(pl.multiple_of(q * R2, R2), R2)
    w = wout_ref[e, ks, cols]  # issued before the wait: the weight does not depend on it
    target = (epoch_ref[0] + 1) * per_slab
    # Interpret mode runs the programs in order, so there the first read must already see every arrival: a
    # miscount then gives a wrong answer instead of a hang.
    cap = 1 if interpret else 2 ** 30
    jax.lax.while_loop(lambda c: (c[0] - target < 0) & (c[1] <= cap),
                       lambda c: (plt.atomic_add(cnt_ref, (q + 1,), zero), c[1] + 1), (target - 1, zero))
    u = load(p1_ref.at[0, ks])
    for p in range(1, s1):
      u = u + load(p1_ref.at[p, ks])
    h = act(u.astype(jnp.bfloat16).astype(jnp.float32)).astype(jnp.bfloat16).astype(jnp.float32)
    p2_ref[q, cols] = product(h, w)
    barrier()
    old = plt.atomic_add(cnt_ref, (1 + f // R2 + j2,), one)

    @pl.when((old & (s2 - 1)) == s2 - 1)  # this call's last program of the column block
    def _finish():
      t = load(p2_ref.at[0, cols])
      for p in range(1, s2):
        t = t + load(p2_ref.at[p, cols])
      yc = (c_ref[0] * t.astype(jnp.bfloat16).astype(jnp.float32)).astype(jnp.bfloat16).astype(jnp.float32)
      y_ref[0, cols] = (res_ref[0, cols].astype(jnp.float32) + yc).astype(y_ref.dtype)


def counters(d: int, f: int):
  """A zeroed counter buffer: one W_out slab's arrivals each, one column block's W_out programs each."""
  return jnp.zeros((1 + f // R2 + d // BN2,), jnp.int32)


@functools.partial(jax.jit, static_argnames=("act", "rows_in", "use_dot", "num_warps", "interpret"))
def dataflow_ffn(x, resid, c, ids, w_in, w_out, epoch, cnt, *, act=jax.nn.gelu, rows_in=512, use_dot=False,
                 num_warps=4, interpret=False):
  """(y [1, d], the counters after the call): the module docstring's y, in one kernel."""
  d, f = w_in.shape[1:]
  s1, s2 = d // rows_in, f // R2
  per_slab = (R2 // BN1) * s1
  if s2 & (s2 - 1) or per_slab & (per_slab - 1):
    raise ValueError(f"the counts a call adds must be powers of two; got {s2} and {per_slab}")
  kernel = functools.partial(_kernel, act=PLAIN[act], rows_in=rows_in, use_dot=use_dot, interpret=interpret)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
  y, _, _, cnt = pl.pallas_call(
      kernel, grid=((f // BN1) * s1 + (d // BN2) * s2,),
      in_specs=[pl.no_block_spec] * 8, out_specs=[pl.no_block_spec] * 4,
      out_shape=[jax.ShapeDtypeStruct((1, d), x.dtype), jax.ShapeDtypeStruct((s1, f), jnp.float32),
                 jax.ShapeDtypeStruct((s2, d), jnp.float32), jax.ShapeDtypeStruct(cnt.shape, jnp.int32)],
      input_output_aliases={7: 3}, interpret=interpret, compiler_params=params, name="probe_dataflow_ffn",
  )(ids.astype(jnp.int32), c.astype(jnp.float32), x, resid, w_in, w_out, jnp.reshape(epoch, (1,)).astype(jnp.int32),
    cnt)
  return y, cnt


def two_kernels(x, resid, c, ids, w_in, w_out, act=jax.nn.gelu):
  """What decode_moe runs at one token, top-1: skinny_ffn (its two kernels), then XLA's combine and residual."""
  t = skinny_ffn(x, w_in, w_out, experts=ids, activation=act)[0].astype(jnp.bfloat16).astype(jnp.float32)
  return (resid.astype(jnp.float32) + (c[0] * t).astype(jnp.bfloat16).astype(jnp.float32)).astype(x.dtype)


def reference(x, resid, c, ids, w_in, w_out, act=jax.nn.gelu):
  f32 = lambda v: v.astype(jnp.float32)
  rnd = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)
  h = rnd(act(rnd(jnp.dot(f32(x), f32(w_in[ids[0]]), precision="highest"))))
  t = rnd(jnp.dot(h, f32(w_out[ids[0]]), precision="highest"))
  return (f32(resid) + rnd(c[0] * t)).astype(x.dtype)


def _weights(key, layers, experts, d, f):
  ks = jax.random.split(key, 2 * layers)
  w_in = [(jax.random.normal(ks[i], (experts, d, f), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
          for i in range(layers)]
  w_out = [(jax.random.normal(ks[layers + i], (experts, f, d), jnp.float32) / f ** 0.5).astype(jnp.bfloat16)
           for i in range(layers)]
  return w_in, w_out


def chain_inputs(layers: int, experts: int, d: int, f: int):
  """(w_in, w_out, ids, c, x0) of a timed chain: each layer's own experts, the expert it reads, a combine weight,
  the first row."""
  w_in, w_out = _weights(jax.random.key(1), layers, experts, d, f)
  ids = [jnp.array([l % experts], jnp.int32) for l in range(layers)]
  return w_in, w_out, ids, jnp.array([0.6], jnp.float32), jax.random.normal(jax.random.key(2), (1, d), jnp.bfloat16)


def check(interpret: bool, d: int = 512, f: int = 1024) -> dict:
  """Largest |y - reference| of every variant over three calls on one counter buffer, and across the int32
  wrap-around of the counters (interpret mode on the CPU)."""
  key = jax.random.key(0)
  x = jax.random.normal(jax.random.fold_in(key, 1), (1, d), jnp.bfloat16)
  res = jax.random.normal(jax.random.fold_in(key, 2), (1, d), jnp.bfloat16)
  (w_in,), (w_out,) = _weights(key, 1, 3, d, f)
  ids = jnp.array([2], jnp.int32)
  errs = {}
  for name, (rows_in, use_dot, warps, _) in VARIANTS.items():
    if d % rows_in:
      continue
    cnt, err = counters(d, f), 0.0
    per_slab = (R2 // BN1) * (d // rows_in)
    for call, epoch in enumerate((0, 1, 2, None)):
      if epoch is None:  # counters just short of int32's wrap: this call's arrivals cross it
        epoch = (2 ** 31 - 1) // per_slab
        cnt = counters(d, f).at[1:1 + f // R2].set(epoch * per_slab)
      # A combine weight of its own each call: an output left unwritten (or stale) differs from the reference.
      c = jnp.array([0.7 - 0.5 * call], jnp.float32)
      want = reference(x, res, c, ids, w_in, w_out).astype(jnp.float32)
      y, cnt = dataflow_ffn(x, res, c, ids, w_in, w_out, jnp.int32(epoch), cnt, rows_in=rows_in, use_dot=use_dot,
                            num_warps=warps, interpret=interpret)
      e = float(jnp.max(jnp.abs(y.astype(jnp.float32) - want)))
      err = max(err, e) if np.isfinite(e) else float("inf")  # max() would drop a NaN
    errs[name] = err
  return errs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  chain_timing.add_chain_args(ap, "FFNs in the chain, each with its own weights")
  ap.add_argument("--experts", type=int, default=4, help="experts a layer (one is read)")
  args = ap.parse_args(argv)
  errs, on_gpu = chain_timing.run_check(check, "max |y - reference| over 4 calls")
  if not on_gpu:
    return errs
  d, f, L = 1024, 4096, args.layers
  w_in, w_out, ids, c, x0 = chain_inputs(L, args.experts, d, f)
  halve = chain_timing.halve

  def chain_two(x, wi, wo):
    def body(_, x):
      for l in range(L):
        x = halve(two_kernels(x, x, c, ids[l], wi[l], wo[l]))
      return x
    return jax.lax.fori_loop(0, args.steps, body, x)

  def chain_dataflow(x, wi, wo, *, rows_in, use_dot, num_warps, fresh):
    def body(step, carry):
      x, cnts = carry
      out = []
      for l in range(L):
        cnt = counters(d, f) if fresh else cnts[l]
        x, cnt = dataflow_ffn(x, x, c, ids[l], wi[l], wo[l], 0 if fresh else step, cnt, rows_in=rows_in,
                              use_dot=use_dot, num_warps=num_warps)
        x = halve(x)
        out.append(cnt)
      return x, out
    return jax.lax.fori_loop(0, args.steps, body, (x, [counters(d, f)] * L))[0]

  fns = {"two_kernels": jax.jit(chain_two)}
  for name, (rows_in, use_dot, warps, fresh) in VARIANTS.items():
    fns[name] = jax.jit(functools.partial(chain_dataflow, rows_in=rows_in, use_dot=use_dot, num_warps=warps,
                                          fresh=fresh))
  args_of = dict.fromkeys(fns, (x0, w_in, w_out))
  chain_timing.compare_outputs(fns, args_of, "two_kernels", f"chain of {args.steps} x {L} FFNs")
  times = chain_timing.time_interleaved(fns, args_of, args.rounds, args.steps * L)
  chain_timing.print_times(times, "two_kernels", "a layer's FFN")
  if args.trace:
    traced = ("two_kernels", "dataflow_r512_w4")  # the split form and the best one kernel
    chain_timing.print_trace({n: fns[n] for n in traced}, args_of, args.trace, args.steps * L, "a layer")
  return times


if __name__ == "__main__":
  main()
