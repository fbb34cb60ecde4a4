"""Is a decode feed-forward faster as ONE kernel in which each program owns a slab of the hidden layer?

At batch 1 a medium-moe layer's expert FFN is two one-wave Pallas Triton kernels (skinny_ffn), each a few us
of ramp, loads in flight and tail for its 8 MB. Here program j of G owns hidden columns F_j (c = f / G of them)
and takes them through both products, so it waits on no other program:

  u_j = x W_in[e][:, F_j]      h_j = round(act(round(u_j)))      part_j = h_j W_out[e][F_j, :]   (float32 [d])

and XLA's fusion that adds the combine weight and the residual also sums the G parts:
  y = resid + round(c * round(sum_j part_j)).
A program issues both of its slabs' loads (W_in's 64-byte rows, W_out's contiguous rows; 128 KB at G = 128)
before it multiplies, so the one kernel has all 16 MB of the expert's weights in flight from its start. The
fifteenth session's one-kernel FFN of the same split looped over K, which left few loads in flight.
"read_only" variants load the same slabs and only sum them: the floor of this kernel's form; "_t" variants
read W_in stored transposed ([E, f, d]), so that its slab is contiguous too; "parts_minor" stores the parts as
[d, G], so that their sum is a row reduction for XLA.

Measured on an H100 (experiments/results/decode_slab_ffn{,2}{,_trace}_H100.log; notes_decode.md, twenty-fifth
session): at medium's d 1,024, f 4,096 the best form (G = 128, 8 warps) ran the chain at 0.91-0.96x the split
form's two kernels (11.4-11.9 against 12.4 us a layer). Traced, its kernel takes 9.0-9.2 us against 5.2 + 6.1,
but the sum of its 128 parts is an XLA reduction of its own (1.45 us), so the layer gains ~0.7 us. The
read-only floor of the same loads is 8.0-8.8 us: the kernel is at it. parts_minor's strided stores cost 2 us
and XLA still reduces in a kernel of its own (decode_slab_ffn_parts_minor_H100.log). In the library (commit 2ab797a,
reverted) the medium-moe step's device time fell 2% and three A-B rounds of the step could not resolve it.

GPU:  python experiments/probe_slab_ffn.py [--layers 24 --steps 100 --rounds 7]
CPU:  the same command checks every variant in interpret mode at small sizes.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from sparsejax.activations import PLAIN
import chain_timing
from probe_dataflow_ffn import _weights, chain_inputs, reference, two_kernels

# name: (programs G, warps, loop steps over K of W_in (1: one load of each slab), read only, W_in stored
# transposed [E, f, d] so a program's W_in slab is contiguous too)
VARIANTS = {
    "slab_g128_w4": (128, 4, 1, False, False),
    "slab_g128_w8": (128, 8, 1, False, False),
    "slab_g128_w16": (128, 16, 1, False, False),
    "slab_g256_w4": (256, 4, 1, False, False),
    "slab_g256_w8": (256, 8, 1, False, False),
    "slab_g64_w8": (64, 8, 1, False, False),
    "slab_g128_w4_k4": (128, 4, 4, False, False),
    "slab_t_g128_w8": (128, 8, 1, False, True),
    "slab_t_g128_w16": (128, 16, 1, False, True),
    "slab_t_g256_w8": (256, 8, 1, False, True),
    "slab_g128_w8_parts_minor": (128, 8, 1, False, False),
    "read_only_g128_w4": (128, 4, 1, True, False),
    "read_only_g128_w8": (128, 8, 1, True, False),
    "read_only_g256_w4": (256, 4, 1, True, False),
    "read_only_t_g128_w8": (128, 8, 1, True, True),
    "read_only_t_g128_w16": (128, 16, 1, True, True),
    "read_only_t_g256_w8": (256, 8, 1, True, True),
}


def _kernel(ids_ref, x_ref, win_ref, wout_ref, out_ref, *, act, c, k_steps, read_only, transposed, parts_minor):
  j = pl.program_id(0)
  e = ids_ref[0]
  d = x_ref.shape[1]
  cols = pl.ds(pl.multiple_of(j * c, c), c)
  f32 = lambda v: v.astype(jnp.float32)
  rnd = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)
  w2 = wout_ref[e, cols, :]  # [c, d]: issued first, it depends on nothing the program computes
  if transposed:
    w1t = win_ref[e, cols, :]  # [c, d]
    if read_only:
      out_ref[j, :] = jnp.sum(f32(w2), axis=0) + jnp.sum(f32(w1t), axis=0)
      return
    u = jnp.sum(f32(x_ref[0, :])[None, :] * f32(w1t), axis=1)
  elif k_steps == 1:
    w1 = win_ref[e, :, cols]  # [d, c]
    if read_only:
      out_ref[j, :] = jnp.sum(f32(w2), axis=0) + jnp.sum(f32(w1), axis=1)
      return
    u = jnp.sum(f32(x_ref[0, :])[:, None] * f32(w1), axis=0)
  else:
    rows = d // k_steps

    def step(i, u):
      ks = pl.ds(pl.multiple_of(i * rows, rows), rows)
      return u + jnp.sum(f32(x_ref[0, ks])[:, None] * f32(win_ref[e, ks, cols]), axis=0)

    u = jax.lax.fori_loop(0, k_steps, step, jnp.zeros((c,), jnp.float32))
  h = rnd(act(rnd(u)))
  part = jnp.sum(h[:, None] * f32(w2), axis=0)
  if parts_minor:  # [d, G]: the sum over j becomes a row reduction for XLA
    out_ref[:, j] = part
  else:
    out_ref[j, :] = part


@functools.partial(jax.jit, static_argnames=("act", "programs", "num_warps", "k_steps", "read_only", "transposed",
                                             "parts_minor", "interpret"))
def slab_parts(x, ids, w_in, w_out, *, act=jax.nn.gelu, programs=128, num_warps=4, k_steps=1, read_only=False,
               transposed=False, parts_minor=False, interpret=False):
  """[G, d] float32 ([d, G] with parts_minor): part_j of the module docstring (x [1, d], ids [1], w_in [E, d, f]
  (transposed: [E, f, d]), w_out [E, f, d])."""
  f, d = w_out.shape[1:]
  if f % programs:
    raise ValueError(f"f={f} is not a multiple of the {programs} programs")
  kernel = functools.partial(_kernel, act=PLAIN[act], c=f // programs, k_steps=k_steps, read_only=read_only,
                             transposed=transposed, parts_minor=parts_minor)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=num_warps, num_stages=3 if k_steps > 1 else 1)
  return pl.pallas_call(
      kernel, grid=(programs,), in_specs=[pl.no_block_spec] * 4, out_specs=pl.no_block_spec,
      out_shape=jax.ShapeDtypeStruct((d, programs) if parts_minor else (programs, d), jnp.float32),
      interpret=interpret, compiler_params=params,
      name="probe_slab_ffn",
  )(ids.astype(jnp.int32), x, w_in, w_out)


def slab_ffn(x, resid, c, ids, w_in, w_out, act=jax.nn.gelu, **kw):
  """y = resid + round(c * round(sum_j part_j)): the kernel, then one XLA fusion (the sum, combine, residual)."""
  t = slab_parts(x, ids, w_in, w_out, act=act, **kw)
  t = t.sum(axis=1)[None] if kw.get("parts_minor") else t.sum(axis=0, keepdims=True)
  t = t.astype(jnp.bfloat16).astype(jnp.float32)
  return (resid.astype(jnp.float32) + (c[0] * t).astype(jnp.bfloat16).astype(jnp.float32)).astype(x.dtype)


def check(interpret: bool, d: int = 256, f: int = 1024) -> dict:
  """Largest |y - reference| of every FFN variant, and of each read_only variant's parts against their sums."""
  key = jax.random.key(0)
  x = jax.random.normal(jax.random.fold_in(key, 1), (1, d), jnp.bfloat16)
  res = jax.random.normal(jax.random.fold_in(key, 2), (1, d), jnp.bfloat16)
  (w_in,), (w_out,) = _weights(key, 1, 3, d, f)
  ids = jnp.array([2], jnp.int32)
  c = jnp.array([0.7], jnp.float32)
  want = reference(x, res, c, ids, w_in, w_out).astype(jnp.float32)
  errs = {}
  for name, (programs, warps, k_steps, read_only, transposed) in VARIANTS.items():
    kw = dict(programs=programs, num_warps=warps, k_steps=k_steps, transposed=transposed, interpret=interpret,
              parts_minor=name.endswith("parts_minor"))
    wi = jnp.swapaxes(w_in, 1, 2) if transposed else w_in
    if read_only:
      got = slab_parts(x, ids, wi, w_out, read_only=True, **kw)
      cs = f // programs
      w1, w2 = w_in[2].astype(jnp.float32), w_out[2].astype(jnp.float32)
      exp = (w2.reshape(programs, cs, d).sum(1) + w1.reshape(d, programs, cs).sum(2).T)
      e = float(jnp.max(jnp.abs(got - exp)))
    else:
      y = slab_ffn(x, res, c, ids, wi, w_out, **kw)
      e = float(jnp.max(jnp.abs(y.astype(jnp.float32) - want)))
    errs[name] = e if np.isfinite(e) else float("inf")
  e = float(jnp.max(jnp.abs(two_kernels(x, res, c, ids, w_in, w_out).astype(jnp.float32) - want)))
  errs["two_kernels"] = e if np.isfinite(e) else float("inf")
  return errs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  chain_timing.add_chain_args(ap, "FFNs in the chain, each with its own weights")
  ap.add_argument("--experts", type=int, default=4, help="experts a layer (one is read)")
  ap.add_argument("--variants", default=",".join(VARIANTS))
  args = ap.parse_args(argv)
  errs, on_gpu = chain_timing.run_check(check, "max |y - reference|")
  if not on_gpu:
    return errs
  d, f, L = 1024, 4096, args.layers
  w_in, w_out, ids, c, x0 = chain_inputs(L, args.experts, d, f)
  halve = chain_timing.halve

  def chain(x, wi, wo, *, ffn):
    def body(_, x):
      for l in range(L):
        x = halve(ffn(x, x, c, ids[l], wi[l], wo[l]))
      return x
    return jax.lax.fori_loop(0, args.steps, body, x)

  w_in_t = [jnp.swapaxes(w, 1, 2) for w in w_in]  # copies made before timing, as a decode layout would be
  fns = {"two_kernels": jax.jit(functools.partial(chain, ffn=two_kernels))}
  args_of = {"two_kernels": (x0, w_in, w_out)}
  for name in filter(None, args.variants.split(",")):
    programs, warps, k_steps, read_only, transposed = VARIANTS[name]
    kw = dict(programs=programs, num_warps=warps, k_steps=k_steps, transposed=transposed,
              parts_minor=name.endswith("parts_minor"))
    args_of[name] = (x0, w_in_t if transposed else w_in, w_out)
    if read_only:  # the parts' sum stands in for the FFN's output, so the chain still depends on every load
      ffn = lambda x, r, c_, i, wi, wo, kw=kw: (r.astype(jnp.float32) + 1e-9 * slab_parts(
          x, i, wi, wo, read_only=True, **kw).sum(0, keepdims=True)).astype(x.dtype)
    else:
      ffn = functools.partial(slab_ffn, **kw)
    fns[name] = jax.jit(functools.partial(chain, ffn=ffn))
  chain_timing.compare_outputs(fns, args_of, "two_kernels", f"chain of {args.steps} x {L} FFNs",
                               skip=lambda n: n.startswith("read_only"))
  times = chain_timing.time_interleaved(fns, args_of, args.rounds, args.steps * L)
  chain_timing.print_times(times, "two_kernels", "a layer's FFN")
  if args.trace:
    chain_timing.print_trace(fns, args_of, args.trace, args.steps * L, "a layer")
  return times


if __name__ == "__main__":
  main()
