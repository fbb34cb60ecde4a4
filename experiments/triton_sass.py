"""A Pallas Triton kernel's SASS without a GPU: the TTIR jax lowers for CUDA, compiled by a triton wheel.

jax lowers a Pallas Triton kernel to Triton IR on any machine (lowering_platforms=("cuda",); jax 0.11 needs the GPU
named, and `lower_for_gpu` names an H100). The triton wheel (3.6 from the registry, in a side venv: it is not a
dependency of this project) compiles that IR for sm_90, and its bundled cuobjdump and nvdisasm read the cubin.
XLA's own Triton is another version, so the SASS is indicative, not the GPU's exact code; it showed the
twenty-fifth session a merge that ran eight dependent L2 round trips and a counting atomic with no CTA barrier
ahead of it (experiments/notes_decode.md).

  python experiments/triton_sass.py overlap_one_grid --out DIR                      # TTIR only (this venv)
  python experiments/triton_sass.py overlap_one_grid --out DIR --triton-python /path/to/venv/bin/python
      --warps 8      # then SASS: registers, stack, and the instructions around each counting atomic
  python experiments/triton_sass.py row_ffn_int8_16 --out DIR --triton-python ...   # a candidate slab width
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

from sparsejax.kernels.pallas_triton_gpu import lower_for_gpu


def _overlap_one_grid():
  import probe_overlap_phases as p
  S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
  return (functools.partial(p.one_kernel_parts, early=True),
          [S((1, p.D), bf), S((p.H, p.C, p.R, p.DH), bf), S((p.D, p.D), bf), S((), jnp.int32), S((1,), jnp.int32)])


def _dataflow_ffn():
  import probe_dataflow_ffn as p
  S, bf, d, f = jax.ShapeDtypeStruct, jnp.bfloat16, 1024, 4096
  return (p.dataflow_ffn, [S((1, d), bf), S((1, d), bf), S((1,), jnp.float32), S((1,), jnp.int32),
                           S((4, d, f), bf), S((4, f, d), bf), S((), jnp.int32), S(p.counters(d, f).shape, jnp.int32)])


def _skinny_int8():
  """skinny_matmul's dot form at medium-moe's batch 32: 32 rows through 22 int8 experts of W_in [1024, 4096], stored
  k-major ([22, 4096, 1024]) as the library stores int8, at the tile default_config picks."""
  from sparsejax.kernels.skinny_matmul import triton as skinny
  S, m, k, n, slots = jax.ShapeDtypeStruct, 32, 1024, 4096, 22
  cfg = skinny.default_config(m, k, n, slots)
  product = functools.partial(_unjitted(skinny.skinny_matmul_parts), source=skinny.Plain(per_slot=False), m=m,
                              dtype=jnp.bfloat16, cfg=cfg, interpret=False)
  return (lambda x, w, ids: product((x,), w=w, experts=ids),
          [S((m, k), jnp.bfloat16), S((slots, n, k), jnp.int8), S((slots,), jnp.int32)])


def _int8_n_major():
  """The same loop with the int8 weight stored n-major ([22, 1024, 4096]) and cast, the library's layout before the
  forty-third session (experiments/probe_int8_weight_layout.py's kernel)."""
  import probe_int8_weight_layout as p
  S, m, k, n, slots = jax.ShapeDtypeStruct, 32, 1024, 4096, 22
  cfg = p.dot_config(m, k, n, slots)
  return (lambda x, w, ids: p.product_parts(x, w, ids, layout="n_major", float_bits=False, cfg=cfg),
          [S((m, k), jnp.bfloat16), S((slots, k, n), jnp.int8), S((slots,), jnp.int32)])


def _row_ffn(w_dtype, slab_bytes: int):
  """The row FFN at medium-moe's batch 1: one row, the RMSNorm folded, through one expert of W_in [1024, 4096] and
  W_out [4096, 1024] (int8 stored k-major, with W_in's scale), each program a slab of slab_bytes of every W_in
  row. The width is patched for the trace only: the case is a candidate's code as an A-B would run it."""
  from sparsejax.kernels.skinny_matmul import triton as skinny, triton_row_ffn as row
  S, d, f, experts, bf = jax.ShapeDtypeStruct, 1024, 4096, 64, jnp.bfloat16
  km = jnp.dtype(w_dtype) == jnp.int8
  parts = functools.partial(_unjitted(row.row_ffn_parts), source=skinny.Normed(eps=1e-6), activation=jax.nn.gelu,
                            dtype=bf, interpret=False)

  def fn(x, g, w_in, w_out, s_in, ids):
    saved = row.SLAB_ROW_BYTES_INT8, row.SLAB_ROW_BYTES, row.WAVE_PROGRAMS
    row.SLAB_ROW_BYTES_INT8 = row.SLAB_ROW_BYTES = slab_bytes
    row.WAVE_PROGRAMS = 0  # the width asked, not narrowed for a wave (64-byte int8 slabs make 64 programs)
    try:
      return parts((x, g), w_in=w_in, w_gate=None, w_out=w_out, s_in=s_in if km else None, s_gate=None, experts=ids)
    finally:
      row.SLAB_ROW_BYTES_INT8, row.SLAB_ROW_BYTES, row.WAVE_PROGRAMS = saved

  return fn, [S((1, d), bf), S((d,), bf), S((experts, f, d) if km else (experts, d, f), w_dtype),
              S((experts, d, f) if km else (experts, f, d), w_dtype), S((experts, f), jnp.float32),
              S((1,), jnp.int32)]


CASES = {"overlap_one_grid": _overlap_one_grid, "dataflow_ffn": _dataflow_ffn,
         "skinny_int8": _skinny_int8, "int8_n_major": _int8_n_major,
         "row_ffn_bf16": functools.partial(_row_ffn, jnp.bfloat16, 64),
         **{f"row_ffn_int8_{b}": functools.partial(_row_ffn, jnp.int8, b) for b in (16, 32, 64)}}


def _unjitted(fn):
  """fn without its jax.jit (through functools.partial): a jitted function already lowered in this process at these
  shapes would come from jax's cache without calling the Triton lowering again."""
  if isinstance(fn, functools.partial):
    return functools.partial(_unjitted(fn.func), *fn.args, **fn.keywords)
  return getattr(fn, "__wrapped__", fn)


def ttir_of(fn, *args) -> list[str]:
  """The Triton IR of every Pallas Triton kernel fn lowers to for CUDA, in lowering order."""
  fn = _unjitted(fn)
  from jax._src.pallas.triton import lowering
  texts, real = [], lowering.lower_jaxpr_to_triton_module

  def hook(*a, **kw):
    result = real(*a, **kw)
    texts.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  lowering.lower_jaxpr_to_triton_module = hook
  try:
    lower_for_gpu(lambda *a: fn(*a), *args)
  finally:
    lowering.lower_jaxpr_to_triton_module = real
  return texts


# Run by --triton-python (a python with the triton wheel): compile one TTIR file, print what the SASS shows.
_COMPILE = r'''
import os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
path, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
cubin = path + ".cubin"
open(cubin, "wb").write(k.asm["cubin"])
tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
res = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
print(" ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", res)))
sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
open(path + ".sass", "w").write(sass)
lines = sass.splitlines()
for key in ("LDG", "LDGSTS", "UTMALDG", "STRONG.SYS", "BAR.SYNC", "ATOMG", "CCTL.IVALL", "I2F", "F2F", "PRMT",
            "STS", "LDS", "LDSM", "HMMA", "HGMMA"):
  print(f"{key}: {sum(key in l for l in lines)}")
for i, l in enumerate(lines):
  if "ATOMG" in l and ", RZ, desc" in l:  # an atomic whose old value is dropped: a program counting itself in
    print("--- before a counting atomic:")
    print("\n".join(x.strip() for x in lines[max(0, i - 12):i + 1]))
'''


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("case", choices=sorted(CASES))
  ap.add_argument("--out", required=True, help="directory for the .ttir (and, compiled, .cubin and .sass) files")
  ap.add_argument("--warps", type=int, default=8)
  ap.add_argument("--stages", type=int, default=1, help="Triton's software pipeline depth (skinny_matmul runs 3)")
  ap.add_argument("--triton-python", help="a python whose environment has the triton wheel: compile and read SASS")
  args = ap.parse_args(argv)
  fn, shapes = CASES[args.case]()
  os.makedirs(args.out, exist_ok=True)
  paths = []
  for i, text in enumerate(ttir_of(fn, *shapes)):
    paths.append(os.path.join(args.out, f"{args.case}_{i}.ttir"))
    with open(paths[-1], "w") as f:
      f.write(text)
    print(f"{paths[-1]}: {len(text.splitlines())} lines of TTIR")
  if args.triton_python:
    for path in paths:
      out = subprocess.run([args.triton_python, "-c", _COMPILE, path, str(args.warps), str(args.stages)],
                           capture_output=True, text=True)
      if out.returncode:
        sys.exit(f"compiling {path} failed: {out.stderr.strip().splitlines()[-1]}")
      print(out.stdout)
  return paths


if __name__ == "__main__":
  main()
