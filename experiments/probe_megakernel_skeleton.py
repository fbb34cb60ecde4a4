"""A step megakernel's skeleton for medium-moe at one row: copies, grid barriers, dependent reads and products.

probe_persistent_layer_mgpu.py's step kernel streams a medium-moe layer's bytes and pays its seven grid barriers, but
no phase reads what the phase before it wrote, and no phase computes: 16.3 us a layer of device time, against 18.6
for the 2x target. What a real megakernel adds on top is the latency chain of each phase after its barrier: load the
previous phase's outputs from L2, reduce them, stage an operand in shared memory, run the product, store the result.
This probe adds that chain with the least arithmetic a phase could do, so its time is a floor for any step megakernel
with this phase structure (seven dependent phases a layer over 128 CTAs):

  every phase      after its barrier, reads a window of 64 CTAs' outputs of the phase before ([64, 64] float32, 16 KB
                   from L2, the size of the real phases' reads: 2-34 KB) and sums it into v [64]
  heavy phase      v, rounded to bf16 and tiled along K, is the B operand ([8, 64], K-minor) of a wgmma whose A operand
                   is the CTA's weight slab ([64, K] bf16, already copied by TMA): 64 outputs a CTA, 8 columns, the
                   cheapest wgmma shape that holds one row
  the expert       v picks one of two expert slabs (data-dependent, as the router's top-1 is), whose 128 KB copy is
                   issued only then; two products in a row (W_in then W_out), the first's output moved from the row to
                   the column layout through shared memory
  light phase      (the merge, the router, the epilogue) v scaled
  every phase      stores its 64 outputs to global memory, then signals its grid barrier

Slabs a layer, a CTA: qkv 48 KB, attention 16 KB, W_o 16 KB (the next layer's copied right after this layer's W_o
phase, as probe_persistent_layer_mgpu's step_next), expert 128 KB: 27.3 MB a layer at P = 128 CTAs, a medium-moe
layer's bytes.

  full        barriers, reads and products
  no_mma      barriers and reads; a heavy phase's output is v itself (no wgmma), so full - no_mma is the products
  no_reads    barriers and products on a constant v (from iota), no reads of other CTAs' outputs (the expert still
              chooses)
  no_barrier  full without grid barriers (wrong by design: a CTA may read outputs not yet written); the latency chain
              alone
  row         each phase reads one other CTA's 64 outputs (256 B, the least a dependent phase can read)
  rows8/32    each phase reads 8 or 32 other CTAs' outputs (2 or 8 KB), as independent 256 B loads, and
              RMS-normalizes their sum
  *_acc4      each product's K chunks spread over 4 accumulators (independent wgmma chains), summed at the end

Grid barriers cannot run in interpret mode (blocks run one after another), and jax 0.10.2's interpreter has no
plgpu.load and no transposed wgmma operand, so the CPU test lowers every variant for CUDA and checks the reference;
the GPU run checks every variant with barriers and products, every phase output, against the reference.

Measured on an H100 (us a layer, a chain of 50 x 24 with XLA's command buffers on; results/megakernel_skeleton{,
_peer,_row_acc4}_H100.log): full 34.3 / 34.2, no_mma 29.9, no_reads 20.8, no_barrier 28.2, row 22.0, row_acc4 22.6,
row_no_mma 18.3, no_reads_acc4 21.3; probe_persistent_layer_mgpu's step_next 17.0 on the same machine. So after the
stream and the barriers (17.0), the least read a phase can make costs 1.2-1.3 us a layer, a 16 KB read 1.7 us a
phase, and the cheapest products 3.7-4.5 us a layer: 22.0 us (2.3x the bytes) before any other arithmetic, against
18.6 for the 2x target (notes_decode.md, thirty-eighth session). At 4 layers (results/megakernel_skeleton_rows_L4_H100
.log) row 21.7, rows8 32.1, rows32 61.0, full 34.6: independent row loads cost 0.18 us each, one after another, so the
real phases' 2-34 KB reads would take a megakernel past today's 28.5 us a layer (thirty-ninth session). The 24-layer
rows8 / rows32 chains take many minutes to compile; use --layers 4.

GPU:  python experiments/probe_megakernel_skeleton.py [--layers 24 --steps 50 --rounds 7]
"""
from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering

import chain_timing
from probe_persistent_layer_mgpu import _signal_gpu_lowering, signal_gpu, signal_gpu_p

mgpu_lowering.register_lowering_rule(signal_gpu_p, mgpu.LoweringSemantics.Lane)(_signal_gpu_lowering)

W = 64          # rows of a window, outputs a CTA, K columns of a chunk
BOX = 256       # rows a TMA copy
P = 128         # CTAs
# (name, K chunks of the CTA's slab; 0 a light phase). The expert's 16 chunks are two products of 8.
PHASES = (("qkv", 6), ("attention", 2), ("merge", 0), ("w_o", 2), ("router", 0), ("expert", 16), ("epilogue", 0))
CHUNKS = dict(PHASES)
_V = lambda mma=True, reads="window", barriers=True, accs=1: dict(mma=mma, reads=reads, barriers=barriers, accs=accs)
VARIANTS = {"full": _V(), "no_mma": _V(mma=False), "no_reads": _V(reads=None), "no_barrier": _V(barriers=False),
            "row": _V(reads="row"), "row_acc4": _V(reads="row", accs=4), "no_reads_acc4": _V(reads=None, accs=4),
            "row_no_mma": _V(reads="row", mma=False), "rows8": _V(reads=8), "rows32": _V(reads=32)}
LIGHT_SCALE = {"window": 0.125, "row": 1.0, 8: 1.0, 32: 1.0, None: 0.125}  # keeps v's magnitude (a window: 64 rows / 8)


def _transforms():
  return (plgpu.TilingTransform((8, W)), plgpu.SwizzleTransform(128))


def _scale(chunks: int) -> float:
  """A product's outputs summed over wgmma's 8 equal columns, back to v's magnitude."""
  return 1.0 / (8.0 * float(np.sqrt(W * chunks)))


def _rms_normalized(s):
  """s / rms(s): keeps a sum of rows at unit scale, phase after phase (an RMSNorm's arithmetic)."""
  return s * lax.rsqrt(jnp.sum(s * s, axis=-1, keepdims=s.ndim > 1) * (1 / W) + 1e-6)


def _constant_v(iota):
  """no_reads' v, from iota over [W]."""
  return (iota % 7 - 3).astype(jnp.float32) * 0.25


def _body(dep, qkv, att, w_o, exp, outs, *, mma, reads, barriers, accs):
  """dep [P, W] f32; qkv / att / w_o [L, P, rows, W] bf16; exp [L, 2, P, 16 W, W]; outs [L * 7, P, W] f32."""
  layers, num = qkv.shape[0], qkv.shape[1]
  p = lax.axis_index("x")
  base = (p // W) * W
  nph = len(PHASES)
  count = layers * nph - 1
  heavy_refs = {"qkv": qkv, "attention": att, "w_o": w_o}

  def scoped(qkv_s, att_s, w_o_s, exp_s, b_s, h_s, qkv_ready, att_ready, w_o_ready, exp_ready):
    sems = [pl.get_global(plgpu.SemaphoreType.REGULAR) for _ in range(count)] if barriers else []
    smem = {"qkv": qkv_s, "attention": att_s, "w_o": w_o_s}
    ready = {"qkv": qkv_ready, "attention": att_ready, "w_o": w_o_ready}

    def copy(src, dst, bar):
      rows = src.shape[0]
      for j in range(0, rows, BOX):
        n = min(BOX, rows - j)
        plgpu.copy_gmem_to_smem(src.at[pl.ds(j, n)], dst.at[pl.ds(j, n)], bar)

    def issue_light(l):
      for name, ref in heavy_refs.items():
        copy(ref.at[l, p], smem[name], ready[name])

    def window(k):  # v [W] from phase k - 1's outputs (or dep), as `reads` says
      if not reads:
        iota = plgpu.broadcasted_iota(jnp.int32, (W,), 0, layout=plgpu.Layout.WGMMA.reduce(0))
        return _constant_v(iota)
      src = dep if k == 0 else outs.at[k - 1]
      if reads == "row":  # the least a phase can read: one other CTA's 64 outputs (256 B)
        return plgpu.load(src.at[(p + 1) % num], (), layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
      if isinstance(reads, int):  # reads other CTAs' rows (256 B each), summed and RMS-normalized
        rows = [plgpu.load(src.at[(p + j) % num], (), layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                for j in range(1, reads + 1)]
        return _rms_normalized(functools.reduce(lambda a, b: a + b, rows))
      w = plgpu.load(src.at[pl.ds(base, W)], (), layout=plgpu.Layout.WGMMA, optimized=False)
      return jnp.sum(w, axis=0) * 0.125

    def product(slab, first: int, chunks: int, v):  # [W] in the row layout: slab's rows . tile(bf16(v))
      b_s[...] = lax.broadcast_in_dim(v, (W, W), [1]).astype(jnp.bfloat16)
      plgpu.commit_smem()

      n = min(accs, chunks)

      def acc_fn(*acc_refs):  # chunk c into accumulator c % n: n independent wgmma chains
        for c in range(first, first + chunks):
          plgpu.wgmma(acc_refs[(c - first) % n], slab.at[pl.ds(c * W, W)], b_s.at[pl.ds(0, 8)].T)
        return functools.reduce(lambda a, b: a + b, [r[...] for r in acc_refs])

      acc = pl.run_scoped(acc_fn, *[plgpu.ACC((W, 8), jnp.float32) for _ in range(n)])
      return jnp.sum(acc, axis=1) * _scale(chunks)

    def to_columns(h):  # the row layout's vector in the column layout, through shared memory
      h_s[...] = h
      plgpu.commit_smem()
      return plgpu.load(h_s, (), layout=plgpu.Layout.WGMMA.reduce(0))  # a vector store and load: no transpose

    issue_light(0)
    k = 0
    for l in range(layers):
      for name, chunks in PHASES:
        v = window(k)
        if name == "expert":
          e = (jnp.sum(v) > 0).astype(jnp.int32)
          copy(exp.at[l, e, p], exp_s, exp_ready)
          plgpu.barrier_wait(exp_ready)
          if mma:
            out = product(exp_s, chunks // 2, chunks // 2, to_columns(product(exp_s, 0, chunks // 2, v)))
          else:
            out = v
        elif chunks:
          plgpu.barrier_wait(ready[name])
          out = product(smem[name], 0, chunks, v) if mma else v
          if name == "w_o" and l + 1 < layers:
            issue_light(l + 1)
        else:
          out = v * LIGHT_SCALE[reads]
        outs[k, p, :] = out
        if k < count and barriers:
          signal_gpu(sems[k])
          plgpu.semaphore_wait(sems[k], num, decrement=False, memory_scope="gpu")
        k += 1

  rows = lambda name: CHUNKS[name] * W
  pl.run_scoped(scoped,
                *[plgpu.SMEM((rows(n), W), jnp.bfloat16, transforms=_transforms())
                  for n in ("qkv", "attention", "w_o", "expert")],
                plgpu.SMEM((W, W), jnp.bfloat16, transforms=_transforms()),
                plgpu.SMEM((W,), jnp.float32),
                *[plgpu.Barrier(num_arrivals=-(-rows(n) // BOX)) for n in ("qkv", "attention", "w_o", "expert")])


@functools.partial(jax.jit, static_argnames=("mma", "reads", "barriers", "accs"))
def step(dep, qkv, att, w_o, exp, *, mma=True, reads="window", barriers=True, accs=1):
  """[L * 7, P, W] f32: every phase's outputs of one step, all layers in one kernel of P CTAs."""
  layers, num = qkv.shape[0], qkv.shape[1]
  body = functools.partial(_body, mma=mma, reads=reads, barriers=barriers, accs=accs)
  body.__name__ = "probe_megakernel_skeleton"
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((layers * len(PHASES), num, W), jnp.float32),
                      grid=(num,), grid_names=("x",))(dep, qkv, att, w_o, exp)


def reference(dep, qkv, att, w_o, exp, *, reads="window"):
  """Every phase output of a variant with products and the given reads, in float32 with the kernel's roundings (v to
  bf16 before each product)."""
  slabs = {"qkv": qkv, "attention": att, "w_o": w_o}
  num = dep.shape[0]
  prev, outs = dep.astype(jnp.float32), []

  def product(slab, v, first, chunks):  # slab [P, chunks W, W]; v [P, W]
    part = slab[:, first * W:(first + chunks) * W].astype(jnp.float32).reshape(num, chunks, W, W)
    # reduce_precision, not a cast to bf16 and back: XLA:GPU may drop that pair as excess precision, and the
    # reference would then skip the rounding the kernel makes.
    b = jax.lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)
    return jnp.einsum("pcmk,pk->pm", part, b, precision="highest") * (8 * _scale(chunks))

  for l in range(qkv.shape[0]):
    for name, chunks in PHASES:
      if reads == "window":
        v = prev.reshape(num // W, W, W).sum(1).repeat(W, axis=0) * 0.125
      elif reads == "row":
        v = jnp.roll(prev, -1, axis=0)
      elif isinstance(reads, int):
        v = functools.reduce(lambda a, b: a + b, [jnp.roll(prev, -j, axis=0) for j in range(1, reads + 1)])
        v = _rms_normalized(v)
      else:
        v = jnp.broadcast_to(_constant_v(jnp.arange(W, dtype=jnp.int32)), (num, W))
      if name == "expert":
        e = (v.sum(1) > 0).astype(jnp.int32)
        slab = exp[l][e, jnp.arange(num)]
        out = product(slab, product(slab, v, 0, chunks // 2), chunks // 2, chunks // 2)
      elif chunks:
        out = product(slabs[name][l], v, 0, chunks)
      else:
        out = v * LIGHT_SCALE[reads]
      outs.append(out)
      prev = out
  return jnp.stack(outs)


def inputs(key, num: int, layers: int):
  ks = jax.random.split(key, 5)
  slab = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16)
  dep = jax.random.normal(ks[0], (num, W), jnp.float32)
  return (dep, slab(ks[1], (layers, num, CHUNKS["qkv"] * W, W)), slab(ks[2], (layers, num, CHUNKS["attention"] * W, W)),
          slab(ks[3], (layers, num, CHUNKS["w_o"] * W, W)), slab(ks[4], (layers, 2, num, CHUNKS["expert"] * W, W)))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  chain_timing.add_chain_args(ap)
  ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
  ap.set_defaults(steps=50)
  args = ap.parse_args(argv)
  variants = args.variants.split(",")
  if unknown := [n for n in variants if n not in VARIANTS]:
    ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
  if jax.default_backend() != "gpu":
    raise SystemExit("probe_megakernel_skeleton needs a GPU: its grid barriers cannot run in interpret mode")
  # Mosaic GPU's layout inference recurses once per unresolved value: rows8 / rows32 pass Python's default 1,000
  # levels at 4 unrolled layers.
  sys.setrecursionlimit(max(sys.getrecursionlimit(), 100_000))
  small = inputs(jax.random.key(0), P, 2)
  for name in [n for n in variants if VARIANTS[n]["barriers"] and VARIANTS[n]["mma"]]:
    flags = VARIANTS[name]
    want = np.asarray(reference(*small, reads=flags["reads"]))
    for _ in range(3):  # a barrier that let a CTA through early would show as a difference in some call
      got = np.asarray(step(*small, **flags))
      err = np.max(np.abs(got - want)) / np.max(np.abs(want))
      print(f"{name:>10} against the reference, 2 layers: max |diff| / max |want| {err:.3g} "
            f"(max |want| {np.max(np.abs(want)):.3g}; the last phase's {np.max(np.abs(want[-1])):.3g})")
  L = args.layers
  args_in = inputs(jax.random.key(1), P, L)

  def chain(dep, *slabs, flags):
    def body(_, dep):
      return step(dep, *slabs, **flags)[-1] * 0.5 + dep * 0.5
    return jax.lax.fori_loop(0, args.steps, body, dep)

  fns = {n: jax.jit(functools.partial(chain, flags=VARIANTS[n])) for n in variants}
  args_of = {n: args_in for n in variants}
  mb = sum(CHUNKS.values()) * W * W * 2 * P / 1e6
  return chain_timing.compare_and_time(fns, args_of, variants[0], args, L, width=10, megabytes=mb,
                                       skip=lambda n: n != variants[0])


if __name__ == "__main__":
  main()
