"""Can a weight-streaming kernel load its weights while the kernel before it still runs (PDL)?

Programmatic dependent launch (Hopper): a kernel launched as a programmatic dependent may start once every CTA
of the kernel before it has executed `griddepcontrol.launch_dependents` (or exited), and runs up to its own
`griddepcontrol.wait`, which returns when that kernel has finished and its writes are visible. What jax 0.11's
stack does with it (read from the sources, twenty-ninth session; notes_decode.md):

- XLA (`xla_gpu_enable_pdl`, on by default on Hopper) launches every Pallas *Triton* kernel as a dependent and
  puts the wait at the kernel's very start; it never adds `launch_dependents` to one. So a Triton kernel can
  only hide its launch, never its first loads, and the kernel after it starts only when it has exited.
- A Pallas *Mosaic GPU* kernel that calls `plgpu.griddepcontrol_wait()` is launched as a dependent by Mosaic's
  own runtime, with the wait where the kernel puts it; `plgpu.griddepcontrol_launch_dependents()` lets the next
  kernel start early. So a chain of Mosaic kernels can issue each weight's TMA copies before the wait.

This probe times a chain of such kernels, each reading a [rows, 1,024] bf16 weight of its own (a band of rows a
CTA, by TMA into shared memory) and the previous kernel's output (after the wait), and writing a token of both,
so each kernel depends on the one before it with no XLA fusion between them:

  plain     no griddepcontrol: the weight, then the previous output
  wait      the wait first, then as plain (launched as a dependent; the previous kernel triggers at exit)
  trigger   launch_dependents, the wait, then as plain (the next kernel's CTAs may be resident early)
  prefetch  the weight's copies issued, launch_dependents, the wait, then the previous output

Timed as a jitted chain of steps x 24 kernels through 24 distinct weights, 7 interleaved rounds, at sizes from
--mb. If `prefetch` runs a step in about its bytes' time where `plain` pays the fixed cost too, the decode
step's products could overlap their weight streams with the small kernels before them.

GPU:  python experiments/probe_pdl_mosaic.py
CPU:  the same command checks the plain kernel's token in interpret mode (the griddepcontrol forms need a GPU).
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
TOK = 8         # rows of the token a CTA writes
FORMS = ("plain", "wait", "trigger", "prefetch")


def _interpret_params():
  try:
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
  except ImportError:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


@functools.partial(jax.jit, static_argnames=("ctas", "form", "interpret"))
def step(w, prev, *, ctas: int, form: str, interpret: bool = False):
  """[ctas, 2, TOK, CHUNK]: per CTA, rows 0-7 / columns 0-255 of its band of w, then prev[c, 0] (the previous
  kernel's token, read after the wait)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  rows, d = w.shape
  band, q = rows // ctas, d // CHUNK

  def body(w_gmem, prev_gmem, out_gmem, smem, psmem, bar, pbar):
    i = jax.lax.axis_index("b")

    def weights():
      for c in range(q):  # the whole band in flight at once
        plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(i * band, band), pl.ds(c * CHUNK, CHUNK)], smem.at[c], bar)

    if form == "prefetch":
      weights()
    if form in ("trigger", "prefetch"):
      plgpu.griddepcontrol_launch_dependents()
    if form != "plain":
      plgpu.griddepcontrol_wait()
    if form != "prefetch":
      weights()
    plgpu.copy_gmem_to_smem(prev_gmem.at[i, 0], psmem, pbar)
    plgpu.barrier_wait(bar)
    plgpu.barrier_wait(pbar)
    plgpu.copy_smem_to_gmem(smem.at[0, pl.ds(0, TOK)], out_gmem.at[i, 0])
    plgpu.copy_smem_to_gmem(psmem, out_gmem.at[i, 1])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((ctas, 2, TOK, CHUNK), w.dtype), grid=(ctas,), grid_names=("b",),
      scratch_types=[plgpu.SMEM((q, band, CHUNK), w.dtype), plgpu.SMEM((TOK, CHUNK), w.dtype),
                     plgpu.Barrier(num_arrivals=q), plgpu.Barrier(num_arrivals=1)],
      interpret=_interpret_params() if interpret else None,
  )(w, prev)


def want(w, prev, ctas: int):
  band = w.shape[0] // ctas
  return jnp.stack([w.reshape(ctas, band, D)[:, :TOK, :CHUNK], prev[:, 0]], axis=1)


def check(interpret: bool, forms=FORMS, ctas: int = 16) -> dict:
  """Largest |token - what it should hold| of each form (0 when right), on a [1,024, 1,024] weight."""
  w = jax.random.normal(jax.random.key(0), (1024, D), jnp.float32).astype(jnp.bfloat16)
  prev = jax.random.normal(jax.random.key(1), (ctas, 2, TOK, CHUNK), jnp.float32).astype(jnp.bfloat16)
  return {f: float(jnp.max(jnp.abs(step(w, prev, ctas=ctas, form=f, interpret=interpret).astype(jnp.float32)
                                   - want(w, prev, ctas).astype(jnp.float32))))
          for f in forms}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  chain_timing.add_chain_args(ap, "kernels in the chain, each with its own weight")
  ap.add_argument("--mb", default="8,2", help="weight sizes in MB")
  ap.add_argument("--ctas", type=int, default=128)
  ap.add_argument("--forms", default=",".join(FORMS))
  args = ap.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  forms = args.forms.split(",")
  for name, err in check(interpret=not on_gpu, forms=forms if on_gpu else ("plain",)).items():
    print(f"{name:>10}: max |token - want| {err:.3g}")
  if not on_gpu:
    return
  for mb in map(float, args.mb.split(",")):
    rows = int(mb * 2 ** 20) // (2 * D)
    ws = [jax.random.normal(jax.random.key(l), (rows, D), jnp.float32).astype(jnp.bfloat16)
          for l in range(args.layers)]
    p0 = jnp.zeros((args.ctas, 2, TOK, CHUNK), jnp.bfloat16)

    def chain(p, ws, *, form):
      def body(_, p):
        for w in ws:  # each kernel reads the previous one's output directly: no XLA fusion between them
          p = step(w, p, ctas=args.ctas, form=form)
        return p
      return jax.lax.fori_loop(0, args.steps, body, p)

    fns = {f: jax.jit(functools.partial(chain, form=f)) for f in forms}
    args_of = dict.fromkeys(fns, (p0, ws))
    # One pass's output is known: the last weight's token, then the one before it.
    band = rows // args.ctas
    expect = np.asarray(jnp.stack([ws[-1].reshape(args.ctas, band, D)[:, :TOK, :CHUNK],
                                   ws[-2].reshape(args.ctas, band, D)[:, :TOK, :CHUNK]], 1), np.float32)
    for f, g in fns.items():
      out = np.asarray(jax.block_until_ready(g(*args_of[f])), np.float32)
      print(f"{mb:>5g} MB {f:>9}: chain output max |diff| from the expected {np.max(np.abs(out - expect)):.3g}")
    times = chain_timing.time_interleaved(fns, args_of, args.rounds, args.steps * args.layers)
    print(f"{mb:>5g} MB, {args.ctas} CTAs of {band * D * 2 // 1024} KB:")
    chain_timing.print_times(times, "plain", "a kernel", width=10)
    if args.trace:
      chain_timing.print_trace(fns, args_of, f"{args.trace}/{mb:g}MB", args.steps * args.layers, "a kernel")


if __name__ == "__main__":
  main()
