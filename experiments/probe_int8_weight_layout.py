"""What the int8 expert weights' memory layout costs skinny_matmul's loop: k-major (the library's) against n-major.

The library stored an int8 expert weight as it stores a float one, [E, k, n] (n contiguous, "n-major"), until this
probe. Read by skinny_matmul's dot form (32 rows, batch 32's experts), that product streamed 1.7-1.9 TB/s on an H200
where bf16 streams 3.2-3.5 (notes_decode.md, forty-third session). Triton 3.6's SASS of that loop
(experiments/triton_sass.py int8_n_major) shows why: at 32 rows Triton runs mma.sync, whose B operand wants pairs
of consecutive k. In an n-major int8 tile those bytes sit in different rows of shared memory, so each thread
reads them one byte at a time (128 LDS.U8 per 128 x 128 step), and the tile is copied in with 8-byte cp.async.
Stored k-major ([E, n, k], k contiguous), the same tile is read with vector loads and copied with 16-byte cp.async.

Here the library's dot loop is written both ways, with the int8 weight converted by a cast or by float bits
(skinny_matmul.triton.weights_as). Each variant is checked against a float32 product and timed with the library's
bf16 kernel and XLA's dot over contiguous experts, in one process with one timer (tune_skinny_matmul.device_us: the
summed kernel time of a chain of calls over distinct weights, best of three traced calls).

  python experiments/probe_int8_weight_layout.py                     # GPU: medium's W_in and W_out, 32 rows, 22 experts
  python experiments/probe_int8_weight_layout.py --rows 1 --slots 1  # one row, in the dot form (the library runs
                                                                     # one row of K <= 2048 as a multiply-reduce)
Writes experiments/results/int8_weight_layout_<gpu>[_m<rows>][_s<slots>].json (and a copy under $OUT when set).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from sparsejax.kernels.skinny_matmul import triton as skinny  # noqa: E402
from tune_skinny_matmul import device_us, parse_shapes, save  # noqa: E402

SHAPES = [(1024, 4096), (4096, 1024)]  # medium's W_in [d, f] and W_out [f, d]
LAYOUTS = ("n_major", "k_major")


def _kernel(ids_ref, x_ref, w_ref, out_ref, *, k_major: bool, float_bits: bool, steps: int, block_k: int,
            block_n: int):
  s, j, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  expert = jnp.clip(ids_ref[s], 0, w_ref.shape[0] - 1)
  cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)

  def step(i, acc):
    ks = pl.ds(pl.multiple_of((p * steps + i) * block_k, block_k), block_k)
    xs = x_ref[:, ks]
    ws = skinny.weights_as(w_ref[expert, cols, ks] if k_major else w_ref[expert, ks, cols], xs.dtype, float_bits)
    return acc + jax.lax.dot_general(xs, ws, (((1,), (1 if k_major else 0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

  out_ref[...] = jax.lax.fori_loop(0, steps, step, jnp.zeros(out_ref.shape, jnp.float32))


def product_parts(x: Float[Array, "m k"], w, ids: Int[Array, "slots"], *, layout: str, float_bits: bool,
                  cfg: skinny.Config, interpret: bool = False) -> Float[Array, "slots splits m n"]:
  """Split-K partials of y[s] = x @ W[ids[s]], W [E, k, n] stored as w: itself (n_major) or its transpose
  [E, n, k] (k_major); int8 w converted to x's dtype by a cast or by float bits. x's rows must fill a dot (>= 16)."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
  k_major = layout == "k_major"
  m, k = x.shape
  n = w.shape[1] if k_major else w.shape[2]
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  kernel = functools.partial(_kernel, k_major=k_major, float_bits=float_bits,
                             steps=cfg.rows_per_program // cfg.block_k, block_k=cfg.block_k, block_n=cfg.block_n)
  return pl.pallas_call(
      kernel,
      grid=(ids.shape[0], n // cfg.block_n, k // cfg.rows_per_program),
      in_specs=[pl.no_block_spec] * 3,
      out_specs=pl.BlockSpec((None, None, m, cfg.block_n), lambda s, j, p: (s, p, 0, j)),
      out_shape=jax.ShapeDtypeStruct((ids.shape[0], k // cfg.rows_per_program, m, n), jnp.float32),
      interpret=interpret,
      compiler_params=params,
      name="probe_int8_weight_layout",
  )(ids.astype(jnp.int32), x, w)


def dot_config(m: int, k: int, n: int, slots: int) -> skinny.Config:
  """The library's tile at these sizes, in its dot form (one row included: the probe times the dot)."""
  cfg = skinny.default_config(max(m, 2), k, n, slots)
  return skinny.Config(block_n=cfg.block_n, block_k=cfg.block_k, rows_per_program=cfg.rows_per_program, use_dot=True)


def variants(m: int, k: int, n: int, slots: int, interpret: bool) -> dict:
  """name -> (fn(x, w, ids) -> y [slots, m, n] float32, weight kind: int8 n-major / int8 k-major / bf16)."""
  cfg = dot_config(m, k, n, slots)
  mp = skinny.padded_rows(m, True)

  def padded(f):  # rows padded to fill the dot, partials summed, padding rows dropped
    return lambda x, w, ids: f(jnp.pad(x, ((0, mp - m), (0, 0))), w, ids).sum(axis=1)[:, :m]

  out = {}
  for layout in LAYOUTS:
    for bits in (False, True):
      out[f"int8_{layout}_{'bits' if bits else 'cast'}"] = (padded(functools.partial(
          product_parts, layout=layout, float_bits=bits, cfg=cfg, interpret=interpret)), f"int8_{layout}")
  library = skinny.default_config(m, k, n, slots)

  def library_product(x, w, ids):  # the library's kernel as the decode step runs it, int8 or bf16 weights
    return skinny.skinny_matmul_parts((x,), skinny.Plain(per_slot=False), w, ids, m, x.dtype, library,
                                      interpret=interpret).sum(axis=1)[:, :m]

  out["int8_library"] = (library_product, "int8_k_major")  # the library stores int8 k-major (reference.k_major)
  out["bf16_library"] = (library_product, "bf16")
  out["int8_xla_dot"] = (lambda x, w, ids: jnp.einsum("mk,skn->smn", x, w.astype(x.dtype),
                                                      preferred_element_type=jnp.float32), "int8_n_major")
  return out


def weight_sets(slots: int, k: int, n: int, chain: int) -> dict:
  """chain distinct int8 weights [slots, k, n] drawn from [-127, 127], the same transposed, and bf16 normals."""
  q = tuple(jax.random.randint(jax.random.key(10 + i), (slots, k, n), -127, 128, jnp.int32).astype(jnp.int8)
            for i in range(chain))
  return {"int8_n_major": q, "int8_k_major": tuple(jnp.swapaxes(w, 1, 2) for w in q),
          "bf16": tuple(jax.random.normal(jax.random.key(50 + i), (slots, k, n), jnp.bfloat16) for i in range(chain))}


def run(shapes, m: int, slots: int, chain: int) -> list[dict]:
  """Every variant checked against the float32 product of the weights it reads (the int8 set, or the bf16 one),
  then timed."""
  interpret = jax.default_backend() != "gpu"
  ids = jnp.arange(slots, dtype=jnp.int32)
  rows = []
  for k, n in shapes:
    x = jax.random.normal(jax.random.key(2), (m, k), jnp.bfloat16)
    sets = weight_sets(slots, k, n, chain)
    exact = jax.jit(lambda x, ws: jnp.stack([jnp.einsum(
        "mk,skn->smn", x.astype(jnp.float32), w.astype(jnp.float32), precision="highest") for w in ws]))
    wants = {"int8": np.asarray(exact(x, sets["int8_n_major"])), "bf16": np.asarray(exact(x, sets["bf16"]))}
    for name, (f, kind) in variants(m, k, n, slots, interpret).items():
      g = jax.jit(lambda x, ws, f=f: jnp.stack([f(x, w, ids) for w in ws]))
      row = dict(m=m, k=k, n=n, slots=slots, variant=name)
      try:
        got, want = np.asarray(g(x, sets[kind])), wants["bf16" if kind == "bf16" else "int8"]
        row["rel_err"] = float(np.abs(got - want).max() / np.abs(want).max())
        assert row["rel_err"] < 1e-4, f"{name}: rel err {row['rel_err']:.2e}"
        us, _ = device_us(g, x, sets[kind])
        row.update(us=us / chain, GBps=chain * sets[kind][0].nbytes / us / 1e3)
      except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others
        row["error"] = f"{type(e).__name__}: {e}"[:300]
      rows.append(row)
      print(f"[{k}, {n}] {name:22s} " + (f"{row['us']:8.2f} us {row['GBps']:6.0f} GB/s" if "us" in row
                                         else row.get("error", "")) + (
          f"  rel err {row['rel_err']:.1e}" if "rel_err" in row else ""), flush=True)
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=int, default=32, help="m, the rows of x (at most 64)")
  ap.add_argument("--slots", type=int, default=22, help="experts one call reads")
  ap.add_argument("--chain", type=int, default=8, help="calls chained over distinct weights")
  ap.add_argument("--shapes", default=None, help="comma-separated KxN (default: medium's W_in and W_out)")
  ap.add_argument("--smoke", action="store_true", help="one small shape, interpreted (runs on a CPU)")
  ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
  args = ap.parse_args(argv)
  if not 1 <= args.rows <= 64:
    ap.error(f"--rows must be in [1, 64]; got {args.rows}")
  shapes = parse_shapes(ap, args.shapes, SHAPES)
  if args.smoke:
    return run([(256, 256)], args.rows, min(args.slots, 2), chain=1)
  if jax.default_backend() != "gpu":
    sys.exit("probe_int8_weight_layout times Pallas Triton kernels: run it on a GPU (or --smoke)")
  rows = run(shapes, args.rows, args.slots, args.chain)
  suffix = (f"_m{args.rows}" if args.rows != 32 else "") + (f"_s{args.slots}" if args.slots != 22 else "")
  save(rows, args.out_dir, "int8_weight_layout", suffix)
  return rows


if __name__ == "__main__":
  main()
