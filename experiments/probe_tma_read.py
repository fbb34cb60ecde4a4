"""How fast can ONE kernel read a decode layer's weight, by TMA into shared memory against Triton's loads?

At one row a product's time is mostly fixed cost (ramp, first loads' latency, tail), not bytes: a one-wave
Triton read of 16 MB takes ~8 us, of 8 MB ~5 us, where the card's copy bandwidth (~2.6-3 TB/s read+write)
would allow ~5.5 and ~2.8 (experiments/probe_slab_ffn.py). A Triton program's loads land in registers, which
caps the bytes it has in flight; a TMA copy lands in shared memory, so a CTA can ask for its whole share
(128 KB) at once. This probe reads a [rows, 1,024] bf16 weight both ways, each CTA / program a contiguous
band of rows, and writes a token of what it read (TMA: 8 rows of its first chunk copied back out; Triton:
the band's column sums), so the reads cannot be dropped:

  tma_gG     G CTAs, each 4 TMA copies of [rows / G, 256] into one barrier, then one wait
  triton_gG  G programs of 8 warps, each one load of its [rows / G, 1,024] band

  glue       no kernel: an XLA slice of the weight in the read's place (the chain's own cost)

Timed as a jitted chain of 100 x 24 reads through 24 distinct weights (7 interleaved rounds), at sizes from
--mb: the slope is the marginal cost of a byte, the rest the kernel's fixed cost.

Measured on an H100 (experiments/results/decode_tma_read{,_sizes}_H100.log; notes_decode.md, twenty-fifth
session): TMA and Triton's loads read alike from 4 MB up (16 MB 10.9-11.2 us a chain step, 8 MB 8.1-8.6, at
every grid), and TMA is 0.2-0.75 us slower below. From 4 to 16 MB a read costs 0.34-0.40 us a MB more
(2.6-3.1 TB/s); the line's intercept is 5.3 us, of which the chain's own XLA fusions are 1.3-2.6: a fixed
cost of about 3-4 us a kernel, the same for either load path.

GPU:  python experiments/probe_tma_read.py
CPU:  the same command checks both kernels' tokens in interpret mode at a small size.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import chain_timing

D = 1024        # the weight's columns (medium's d)
CHUNK = 256     # TMA box: at most 256 elements a dimension
SMEM_BYTES = 227 * 1024  # a CTA's shared memory on sm_90: tma_read holds its whole band
VARIANTS = {"tma_g128": ("tma", 128), "tma_g256": ("tma", 256), "tma_g512": ("tma", 512),
            "triton_g128": ("triton", 128), "triton_g256": ("triton", 256)}


def _interpret_params():
  try:
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
  except ImportError:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


@functools.partial(jax.jit, static_argnames=("ctas", "interpret"))
def tma_read(w, dep, *, ctas: int, interpret: bool = False):
  """[ctas, 8, CHUNK]: rows 0-7 (fewer if the band has fewer), columns 0-255 of each CTA's band, after the whole band arrived. dep is not
  read: an operand that ties the call to the chain, so XLA cannot hoist it out of the loop."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  rows, d = w.shape
  band, q = rows // ctas, d // CHUNK
  tok = min(8, band)

  def body(w_gmem, dep_gmem, out_gmem, smem, bar):
    i = jax.lax.axis_index("b")
    for c in range(q):  # every copy issued before the one wait: the whole band in flight at once
      plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(i * band, band), pl.ds(c * CHUNK, CHUNK)], smem.at[c], bar)
    plgpu.barrier_wait(bar)
    plgpu.copy_smem_to_gmem(smem.at[0, pl.ds(0, tok)], out_gmem.at[i])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((ctas, tok, CHUNK), w.dtype), grid=(ctas,), grid_names=("b",),
      scratch_types=[plgpu.SMEM((q, band, CHUNK), w.dtype), plgpu.Barrier(num_arrivals=q)],
      interpret=_interpret_params() if interpret else None,
  )(w, dep)


@functools.partial(jax.jit, static_argnames=("programs", "interpret"))
def triton_read(w, dep, *, programs: int, interpret: bool = False):
  """[programs, d] float32: each program's band summed over its rows."""
  rows, d = w.shape
  band = rows // programs

  def kernel(w_ref, dep_ref, out_ref):
    i = pl.program_id(0)
    out_ref[i, :] = jnp.sum(w_ref[pl.ds(pl.multiple_of(i * band, band), band), :].astype(jnp.float32), axis=0)

  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=8, num_stages=1)
  return pl.pallas_call(kernel, grid=(programs,), in_specs=[pl.no_block_spec] * 2, out_specs=pl.no_block_spec,
                        out_shape=jax.ShapeDtypeStruct((programs, d), jnp.float32), interpret=interpret,
                        compiler_params=params, name="probe_triton_read")(w, dep)


def check(interpret: bool, variants=tuple(VARIANTS)) -> dict:
  """Largest |token - what the band holds| of each variant (0 when right), on a [1,024, 1,024] weight."""
  w = jax.random.normal(jax.random.key(0), (1024, D), jnp.float32).astype(jnp.bfloat16)
  errs, dep = {}, jnp.zeros((1,), jnp.float32)
  for name in variants:
    kind, g = VARIANTS[name]
    band = w.shape[0] // g
    if kind == "tma":
      want = w.reshape(g, band, D)[:, :8, :CHUNK].astype(jnp.float32)
      got = tma_read(w, dep, ctas=g, interpret=interpret).astype(jnp.float32)
    else:
      want = w.reshape(g, band, D).astype(jnp.float32).sum(1)
      got = triton_read(w, dep, programs=g, interpret=interpret)
    errs[name] = float(jnp.max(jnp.abs(got - want)))
  return errs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  chain_timing.add_chain_args(ap, "reads in the chain, each of its own weight")
  ap.add_argument("--mb", default="16,8", help="weight sizes in MB")
  ap.add_argument("--variants", default=",".join(VARIANTS) + ",glue",
                  help="glue: the chain without a kernel (an XLA slice of the weight in the read's place)")
  args = ap.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  for name, err in check(interpret=not on_gpu).items():
    print(f"{name:>14}: max |token - band| {err:.3g}")
  if not on_gpu:
    return
  x0 = jnp.zeros((), jnp.float32)
  for mb in map(float, args.mb.split(",")):
    rows = int(mb * 2 ** 20) // (2 * D)
    ws = [jax.random.normal(jax.random.key(l), (rows, D), jnp.float32).astype(jnp.bfloat16)
          for l in range(args.layers)]

    def chain(x, ws, *, read):
      def body(_, x):
        for w in ws:  # each read's token feeds the chain, so none is dropped or reordered past the next
          x = x + 1e-9 * read(w, x.reshape(1)).astype(jnp.float32).sum()
        return x
      return jax.lax.fori_loop(0, args.steps, body, x)

    fns = {}
    for name in args.variants.split(","):
      if name == "glue":
        read = lambda w, dep: w[:8, :CHUNK]
      else:
        kind, g = VARIANTS[name]
        if kind == "tma" and (rows // g) * D * 2 > SMEM_BYTES:
          print(f"{mb:>5g} MB {name:>12}: skipped, a CTA's band of {(rows // g) * D * 2} bytes exceeds shared memory")
          continue
        read = functools.partial(tma_read, ctas=g) if kind == "tma" else functools.partial(triton_read, programs=g)
      fns[name] = jax.jit(functools.partial(chain, read=read))
    args_of = dict.fromkeys(fns, (x0, ws))
    for n, g in fns.items():
      jax.block_until_ready(g(*args_of[n]))
    times = chain_timing.time_interleaved(fns, args_of, args.rounds, args.steps * args.layers)
    for n, t in times.items():
      med = np.median(t)
      print(f"{mb:>5g} MB {n:>12}: {med:6.2f} us a read (median of {args.rounds}, range {min(t):.2f}-{max(t):.2f}; "
            f"{mb * 2 ** 20 / med / 1e6:.2f} TB/s)")
    if args.trace:
      chain_timing.print_trace(fns, args_of, f"{args.trace}/{mb:g}MB", args.steps * args.layers, "a read")


if __name__ == "__main__":
  main()
