"""Does Programmatic Dependent Launch (PDL) shorten a decode-like chain of Pallas Triton products?

A decode step is a chain of short dependent kernels: a weight-streaming product, a small XLA fusion, the
next product. On Hopper a kernel launched as a programmatic dependent may start while its predecessor
drains and run up to a `griddepcontrol.wait` before touching the predecessor's output. XLA 0.11 has the
flags `--xla_gpu_enable_pdl` and `--xla_gpu_enable_pdl_launch` for its own kernels. This probe times
REPEAT x 24 products of one row through distinct [1024, 4096] bf16 weights (192 MB per call at the
default REPEAT, past the L2), with a small XLA fusion between products, in four forms:

  xla         XLA's own dot
  plain       a Pallas Triton product (one [1024, 32] weight slab a program)
  wait_first  the same, a griddepcontrol.wait first
  prefetch    the same, the weight slab loaded before the wait, x after it (x's address depends on
              the wait's result, so the load cannot move above it)
  trigger     plain, its programs first executing griddepcontrol.launch_dependents
              (sparsejax.kernels.launch_dependents' primitive), so the next kernel may launch while it runs

and, with no XLA fusion between products (the kernel computes the fusion's values from the previous output
itself, so two Pallas kernels follow each other as in most of a decode layer): plain_direct, trigger_direct.

Measured: no wait form and no flag moved the chain (results/decode_pdl_probe_H100.log). The trigger (thirty-third
session, results/decode_pdl_trigger_probe_H100.log): within the spread with XLA's fusion between products, 2-6% faster
in every round with the products back to back. Why, read from XLA's sources in
the twenty-ninth session (notes_decode.md): with xla_gpu_enable_pdl on, XLA already launches every Pallas Triton
kernel as a dependent and inserts its own `griddepcontrol.wait` at the kernel's very start, so `prefetch`'s loads
still follow a wait; probe_pdl_mosaic.py tries the same with Mosaic GPU kernels, which place their own wait.

`griddepcontrol.wait` returns at once in a grid not launched as a dependent, so the kernels are correct
under any flags; every form is checked against a float64 host oracle over one pass of the 24 weights
(over 192 products rounding differences grow along the chain, and the check would say little). Run it once per XLA_FLAGS
setting (GPU):

  for f in "" --xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=true; do
    XLA_FLAGS="$f" python experiments/probe_pdl.py; done
"""
from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from peers.common import time_fn

K, N, LAYERS, BLOCK_N = 1024, 4096, 24, 32
# Weights drawn at this scale keep the chain's values at about unit size over 192 products (at 0.03
# the tanh chain decays to zero within a few dozen products and the check compares zeros).
WEIGHT_SCALE = 0.06
MODES = ("xla", "plain", "wait_first", "prefetch", "trigger", "plain_direct", "trigger_direct")


def _grid_dependency_wait(t):
  """griddepcontrol.wait, then t unchanged: its result orders the loads that use it after the wait."""
  from jax.experimental.pallas import triton as plt
  [r] = plt.elementwise_inline_asm("griddepcontrol.wait;\n mov.b32 $0, $1;", args=[t], constraints="=r,r",
                                   pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(t.shape, t.dtype)])
  return r


def _kernel(x_ref, w_ref, o_ref, *, mode):
  j = pl.program_id(0)
  if mode.endswith("_direct"):
    # _between's values from two loads (Pallas Triton lowers no slice of a loaded block)
    x = jnp.tanh(x_ref[pl.ds(0, K)] * 0.5 + x_ref[pl.ds(K, K)] * 0.25).astype(jnp.bfloat16)
    o_ref[...] = jnp.sum(x.astype(jnp.float32)[:, None] * w_ref[:, pl.ds(j * BLOCK_N, BLOCK_N)].astype(jnp.float32),
                         axis=0)
    return
  if mode == "prefetch":
    w = w_ref[:, pl.ds(j * BLOCK_N, BLOCK_N)]
  if mode in ("prefetch", "wait_first"):
    # A reduce of a 32-wide vector: Pallas Triton lowers no scalar inline asm and no slice.
    zero = jnp.min(_grid_dependency_wait(jnp.zeros((32,), jnp.int32) + j)) - j
    x = x_ref[pl.ds(zero, K)]
  else:
    x = x_ref[...]
  if mode != "prefetch":
    w = w_ref[:, pl.ds(j * BLOCK_N, BLOCK_N)]
  o_ref[...] = jnp.sum(x.astype(jnp.float32)[:, None] * w.astype(jnp.float32), axis=0)


def matvec(x, w, mode: str):
  """y = x @ w for one row x [K] and w [K, N], float32."""
  from jax.experimental.pallas import triton as plt

  from sparsejax.kernels import launch_dependents
  kernel = functools.partial(_kernel, mode=mode)
  if mode.startswith("trigger"):
    plain = kernel

    def kernel(*refs):  # the library's trigger, whatever its EARLY switch says
      launch_dependents.launch_dependents_p.bind(refs[-1])
      plain(*refs)
  return pl.pallas_call(kernel, grid=(N // BLOCK_N,),
                        in_specs=[pl.no_block_spec, pl.no_block_spec],
                        out_specs=pl.BlockSpec((BLOCK_N,), lambda j: (j,)),
                        out_shape=jax.ShapeDtypeStruct((N,), jnp.float32),
                        compiler_params=plt.CompilerParams(num_warps=8, num_stages=1),
                        name=f"probe_pdl_{mode}")(x, w)


def _between(x):
  """The small XLA fusion between products."""
  return jnp.tanh(x[:K] * 0.5 + x[K:2 * K] * 0.25).astype(jnp.bfloat16)


def chain(x, ws, mode: str, repeat: int):
  for w in list(ws) * repeat:
    if mode.endswith("_direct"):
      x = matvec(x, w, mode)
      continue
    xin = _between(x)
    x = jnp.dot(xin, w, preferred_element_type=jnp.float32) if mode == "xla" else matvec(xin, w, mode)
  return x


def oracle(x, ws, repeat: int) -> np.ndarray:
  xo = np.asarray(x, np.float64)
  for w in list(ws) * repeat:
    xin = np.asarray(_between(jnp.asarray(xo, jnp.float32)), np.float64)
    xo = xin @ np.asarray(w, np.float64)
  return xo


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeat", type=int, default=8, help="passes over the 24 weights in one call")
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args(argv)
  if jax.default_backend() != "gpu":
    raise SystemExit("probe_pdl.py needs a GPU (its kernels carry PTX inline assembly)")
  key = jax.random.key(0)
  ws = [jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16) * WEIGHT_SCALE
        for i in range(LAYERS)]
  x = jax.random.normal(key, (N,), jnp.float32)
  want = oracle(x, ws, 1)
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  gbytes = args.repeat * LAYERS * K * N * 2 / 1e9
  for mode in MODES:
    got = np.asarray(jax.jit(functools.partial(chain, mode=mode, repeat=1))(x, ws), np.float64)
    print(f"{mode:10s} one pass, rel err against the oracle {np.linalg.norm(got - want) / np.linalg.norm(want):.1e}")
  fns = {m: jax.jit(functools.partial(chain, mode=m, repeat=args.repeat)) for m in MODES}
  for rnd in range(args.rounds):
    for mode, f in fns.items():
      ms = 1e3 * time_fn(f, x, ws, warmup=1, iters=30)
      print(f"round {rnd} {mode:10s} {ms:.3f} ms a call, {1e3 * ms / args.repeat / LAYERS:.2f} us a product, "
            f"{gbytes / ms * 1e3:.0f} GB/s", flush=True)


if __name__ == "__main__":
  main()
