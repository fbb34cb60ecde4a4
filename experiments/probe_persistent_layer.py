"""What would one persistent kernel per decode layer cost, against a kernel per phase? A ceiling probe for issue 14.

A medium-moe layer at one token is a chain of dependent phases: the qkv product, the attention (and its merge),
W_o, the router, the chosen expert's two products, the epilogue. Each is a kernel today, and each costs a fixed
2-4 us beside its bytes (notes_decode.md), so a layer runs ~28 us against the ~9 us its bytes take. The remaining
design named in the notes is a persistent kernel: every program runs every phase, a grid barrier between
phases, and a phase's weights (which do not depend on the data) are loaded *before* the barrier it waits on, so
the bytes stream while the phase before finishes. Earlier one-grid probes handed data between two phases and found
the handoff as dear as the kernel boundary (twenty-fourth to twenty-sixth sessions); they polled their counter
with atomic read-modify-writes, which queue at one L2 slice behind the arrivals they wait for.

This probe strips the layer to its dependence and its bytes. Phase i of P programs: program p loads its slab
w_i[p] ([R_i, D] bf16; R_i = 0 for a light phase), reads every program's output of phase i-1 (P floats) and
stores

  s_i[p] = sum_{r,c} w_i[p, r, c] * v[c] * (1 + mean(s_{i-1}) / 64)      (R_i > 0)
  s_i[p] = 1 + mean(s_{i-1}) / 64                                        (a light phase)

with v the layer's input vector and s_{-1} = 0. The phases' slabs follow a medium-moe layer: 32 rows a program
(W_qkv, 8 MB at P = 128), 8 (the KV cache), none (the merge), 8 (W_o), none (the router), 64 (the expert's 16 MB,
known only after the router, so never loaded early), none (the epilogue): 29 MB a layer, ~10 us at 2.9 TB/s.

  kernels        a pallas_call per phase (grid P), as the library's layer is today
  rmw_late       one kernel, barriers polled with atomic adds of 0, every slab loaded after its wait
  rmw            the same, the data-independent slabs loaded before the wait
  rmw_l2         rmw_late, each program first asking L2 for its data-independent slabs (prefetch.global.L2)
  ld             barriers polled with volatile loads, one atomic to acquire once the count is in
  ld_sleep       the same with a nanosleep between polls
  nowait         the barrier's arrivals but no waits (timing only: its outputs are wrong by design)
  nowait_l2      the same with rmw_l2's prefetches

Barrier counts are never reset (probe_dataflow_ffn.py's epochs): call e of a layer waits in phase i for
(e * phases + i + 1) * P arrivals, compared as an int32 difference so the wrap cancels. Interpret mode runs the
programs one after another, so the CPU checks the kernel at P = 1 (each barrier then waits for the program
itself); the GPU checks every variant at P = 128 against a float64 oracle.

Measured on an H100 (results/persistent_layer{,_l2}_H100.log; two runs, us a layer, chain of 50 x 24 with XLA's
command buffers on / device time traced with them off):

  kernels 25.80-25.85 / 27.2-27.4; rmw_late 26.7-26.8 / 24.6-24.7; rmw 26.3-26.4 / 24.2-24.3; ld 28.5 / 26.3-26.4;
  ld_sleep 28.5 / 26.3-26.4; rmw_l2 27.5 / 25.3; nowait 22.6 / 20.4; nowait_l2 23.5 / 21.3

So one persistent Triton kernel ties the kernel per phase inside a command buffer (its waits cost ~0.65 us each with
RMW polls, more with load polls), and even with no waits at all it needs 20.4 us of device time for 10.1 us of bytes:
each program's phases run one after another, the loads of a phase issued only after the fence of the phase
before (a release fence waits for every earlier access), so each phase pays its own DRAM latency. Loading the
next slab before the wait, or asking L2 for it, does not move that. A megakernel that streams its weights needs
copies decoupled from the program order (TMA into shared memory from a producer warp, as Mosaic GPU or CUDA
write them), not a Triton program's register loads.

GPU:  python experiments/probe_persistent_layer.py [--layers 24 --steps 50 --rounds 7]
CPU:  the same command checks the variants in interpret mode at P = 1.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jax._src import core as jax_core
from jax._src import state
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.state import discharge as state_discharge

import chain_timing

D = 1024
# (name, rows a program, loaded before the wait in the early variants)
PHASES = (("qkv", 32, True), ("attention", 8, True), ("merge", 0, False), ("w_o", 8, True), ("router", 0, False),
          ("expert", 64, False), ("epilogue", 0, False))
HEAVY = tuple(i for i, (_, r, _) in enumerate(PHASES) if r)
VARIANTS = {"rmw_late": ("rmw", False, True), "rmw": ("rmw", True, True), "ld": ("ld", True, True),
            "ld_sleep": ("ld_sleep", True, True), "rmw_l2": ("rmw", "l2", True), "nowait": ("ld", True, False),
            "nowait_l2": ("ld", "l2", False)}
LINE = 64  # bf16 elements in a 128-byte line
NUM_WARPS = 8


def _phase_value(w, v, prev_mean):
  """s_i[p] from the slab (or None), v [D] float32 and mean(s_{i-1})."""
  scale = 1.0 + prev_mean * (1.0 / 64)
  if w is None:
    return scale
  return jnp.sum(w.astype(jnp.float32) * v[None, :]) * scale


def _store(out_ref, i, p, value):
  out_ref[i, pl.ds(p, 1)] = jnp.zeros((1,), jnp.float32) + value


def _phase_kernel(*refs, num_programs):
  """One phase as a kernel of its own: refs = (v, prev, [w,] out)."""
  p = pl.program_id(0)
  v_ref, prev_ref, *w_ref, out_ref = refs
  prev_mean = jnp.sum(prev_ref[...]) * (1.0 / num_programs)
  w = w_ref[0][p] if w_ref else None
  out_ref[pl.ds(p, 1)] = jnp.zeros((1,), jnp.float32) + _phase_value(w, v_ref[...], prev_mean)


def _params(interpret):
  if interpret:
    return None
  from jax.experimental.pallas import triton as plt
  return plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


@functools.partial(jax.jit, static_argnames=("interpret",))
def layer_kernels(v, ws, *, interpret=False):
  """[phases, P] float32: s_i of every phase, a kernel each."""
  num_programs = ws[0].shape[0]
  prev, outs, heavy = jnp.zeros((num_programs,), jnp.float32), [], iter(ws)
  for name, rows, _ in PHASES:
    args = (v, prev) + ((next(heavy),) if rows else ())
    prev = pl.pallas_call(functools.partial(_phase_kernel, num_programs=num_programs), grid=(num_programs,),
                          in_specs=[pl.no_block_spec] * len(args), out_specs=pl.no_block_spec,
                          out_shape=jax.ShapeDtypeStruct((num_programs,), jnp.float32), interpret=interpret,
                          compiler_params=_params(interpret), name=f"probe_phase_{name}")(*args)
    outs.append(prev)
  return jnp.stack(outs)


def _sleep():
  """nanosleep between polls (inline assembly wants a tensor operand; the result is a dummy)."""
  from jax.experimental.pallas import triton as plt
  [r] = plt.elementwise_inline_asm("nanosleep.u32 32;\n mov.b32 $0, $1;", args=[jnp.zeros((32,), jnp.int32)],
                                   constraints="=r,r", pack=1,
                                   result_shape_dtypes=[jax.ShapeDtypeStruct((32,), jnp.int32)])
  return jnp.min(r)


prefetch_p = jax_core.Primitive("probe_prefetch_l2")
prefetch_p.multiple_results = True
# A write effect on a ref it never writes, or jax drops an op whose results nobody uses.
prefetch_p.def_effectful_abstract_eval(lambda ref, offsets: ([], {state.WriteEffect(0)}))
# Called (in_avals, out_avals, ref, offsets) by jax 0.10 and (ctx, ref, offsets) by 0.11; it changes neither operand.
state_discharge.register_discharge_rule(prefetch_p)(lambda *args: ((None, None), []))


@triton_lowering.register_lowering(prefetch_p)
def _prefetch_lowering(ctx, ptr, offsets):
  """prefetch.global.L2 of the line holding each ref.flat[offset]: fire and forget, and not a memory access in
  the memory model, so no fence waits for it (the sparsejax kernels' l2_prefetch of commit 931329d)."""
  shape = ir.RankedTensorType(offsets.type).shape
  ptrs = tt_dialect.addptr(ir.RankedTensorType.get(shape, ptr.type),
                           tt_dialect.splat(ir.RankedTensorType.get(shape, ptr.type), ptr), offsets)
  tt_dialect.elementwise_inline_asm([ir.RankedTensorType.get(shape, ir.IntegerType.get_signless(32))],
                                    "prefetch.global.L2::evict_last [$1];\n\tmov.b32 $0, 0;", constraints="=r,l",
                                    pure=False, packed_element=1, args=[ptrs])
  return []


def _prefetch_slab(w_ref, p):
  """Ask L2 for program p's slab w[p] (interpret mode: a no-op)."""
  _, rows, d = w_ref.shape
  prefetch_p.bind(w_ref, p * (rows * d) + jnp.arange(rows * d // LINE, dtype=jnp.int32) * LINE)


def _persistent_kernel(v_ref, *refs, poll, early, wait, interpret):
  """Every phase in one grid: refs = (w for each heavy phase..., epoch, cnt_in, out, cnt)."""
  from jax.experimental.pallas import triton as plt
  *w_refs, epoch_ref, _, out_ref, cnt_ref = refs
  p = pl.program_id(0)
  num_programs = w_refs[0].shape[0]
  zero = p * 0
  one = zero + 1
  base = epoch_ref[0] * (len(PHASES) * num_programs)
  sync = (lambda: None) if interpret else plt.debug_barrier
  cap = 1 if interpret else 2 ** 30  # interpret mode at P = 1: the program's own arrival is the whole count
  v = v_ref[...]
  w_of = dict(zip(HEAVY, w_refs))
  prev_mean = jnp.float32(0.0)
  if early == "l2":  # every data-independent slab of the layer asked of L2 at once, loaded after its wait
    for i in HEAVY:
      if i and PHASES[i][2]:
        _prefetch_slab(w_of[i], p)
  for i, (_, rows, loads_early) in enumerate(PHASES):
    w = w_of[i][p] if rows and early is True and loads_early else None
    if i and wait:
      target = base + i * num_programs
      if poll == "rmw":
        jax.lax.while_loop(lambda s: (s[0] - target < 0) & (s[1] <= cap),
                           lambda s: (plt.atomic_add(cnt_ref, (zero,), zero), s[1] + 1), (target - 1, zero))
      else:
        def body(s):
          if interpret:  # no volatile loads or inline assembly there, and at P = 1 the loop never runs
            return jnp.min(cnt_ref[...]), s[1] + 1
          count = jnp.min(plt.load(cnt_ref, volatile=True))
          return (count + _sleep() * 0 if poll == "ld_sleep" else count), s[1] + 1
        seen, _ = jax.lax.while_loop(lambda s: (s[0] - target < 0) & (s[1] <= cap), body, (target - 1, zero))
        # acquire, so the phase's outputs are visible to the loads below; its index uses the loop's result, or
        # jax would drop a loop whose only effects are reads
        plt.atomic_add(cnt_ref, ((seen - target) * 0,), zero)
    if i:
      prev_mean = jnp.sum(out_ref[i - 1, :]) * (1.0 / num_programs)
    if rows and w is None:
      w = w_of[i][p]
    _store(out_ref, i, p, _phase_value(w, v, prev_mean))
    sync()  # every thread's store, then one thread's release
    plt.atomic_add(cnt_ref, (zero,), one)


@functools.partial(jax.jit, static_argnames=("poll", "early", "wait", "interpret"))
def layer_persistent(v, ws, epoch, cnt, *, poll="ld", early=True, wait=True, interpret=False):
  """([phases, P] float32 s_i, the counter after the call): the layer as one persistent kernel."""
  num_programs = ws[0].shape[0]
  out, cnt = pl.pallas_call(
      functools.partial(_persistent_kernel, poll=poll, early=early, wait=wait, interpret=interpret),
      grid=(num_programs,), in_specs=[pl.no_block_spec] * (len(ws) + 3), out_specs=[pl.no_block_spec] * 2,
      out_shape=[jax.ShapeDtypeStruct((len(PHASES), num_programs), jnp.float32),
                 jax.ShapeDtypeStruct((1,), jnp.int32)],
      input_output_aliases={len(ws) + 2: 1}, interpret=interpret, compiler_params=_params(interpret),
      name="probe_persistent_layer",
  )(v, *ws, jnp.reshape(epoch, (1,)).astype(jnp.int32), cnt)
  return out, cnt


def reference(v, ws) -> np.ndarray:
  """s_i in float64 on the host."""
  v = np.asarray(v, np.float64)
  heavy = iter(np.asarray(w.astype(jnp.float32), np.float64) for w in ws)
  prev_mean, outs = 0.0, []
  for _, rows, _ in PHASES:
    scale = 1.0 + prev_mean / 64
    s = np.einsum("prc,c->p", next(heavy), v) * scale if rows else np.full((ws[0].shape[0],), scale)
    outs.append(s)
    prev_mean = float(np.mean(s))
  return np.stack(outs)


def inputs(key, num_programs: int, layers: int):
  """v [D] and, per layer, the heavy phases' slabs, scaled so every s_i is about 1."""
  keys = jax.random.split(key, layers + 1)
  v = jax.random.normal(keys[0], (D,), jnp.float32)
  per_layer = []
  for l in range(layers):
    ks = jax.random.split(keys[l + 1], len(HEAVY))
    per_layer.append(tuple((jax.random.normal(k, (num_programs, PHASES[i][1], D), jnp.float32)
                            / (32 * np.sqrt(PHASES[i][1]))).astype(jnp.bfloat16) for k, i in zip(ks, HEAVY)))
  return v, per_layer


def check(interpret: bool) -> dict:
  """Largest relative error of each form against the oracle, over three calls on one counter and one across the
  int32 wrap (nowait excluded on a GPU, where it is wrong by design)."""
  num_programs = 1 if interpret else 128
  v, (ws,) = inputs(jax.random.key(0), num_programs, 1)
  want = reference(v, ws)
  rel = lambda got: float(np.max(np.abs(np.asarray(got, np.float64) - want) / np.maximum(np.abs(want), 1e-3)))
  errs = {"kernels": rel(layer_kernels(v, ws, interpret=interpret))}
  per_call = len(PHASES) * num_programs
  for name, (poll, early, wait) in VARIANTS.items():
    if not wait and not interpret:
      continue
    cnt, err = jnp.zeros((1,), jnp.int32), 0.0
    for epoch in (0, 1, 2, None):
      if epoch is None:  # just short of int32's wrap: this call's arrivals cross it
        epoch = (2 ** 31 - 1) // per_call
        cnt = jnp.full((1,), epoch * per_call, jnp.int32)
      out, cnt = layer_persistent(v, ws, jnp.int32(epoch), cnt, poll=poll, early=early, wait=wait,
                                  interpret=interpret)
      e = rel(out)
      if int(cnt[0]) != int(np.int64((epoch + 1) * per_call).astype(np.int32)):
        e = float("inf")
      err = max(err, e) if np.isfinite(e) else float("inf")
    errs[name] = err
  return errs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  chain_timing.add_chain_args(ap)
  ap.set_defaults(steps=50)
  args = ap.parse_args(argv)
  errs, on_gpu = chain_timing.run_check(check, "max relative error against the oracle", width=10)
  if not on_gpu:
    return errs
  L = args.layers
  v0, per_layer = inputs(jax.random.key(1), 128, L)

  def next_v(v, s):  # the glue between layers: the next input depends on the whole last phase
    return v * (0.5 + 0.5 * jnp.tanh(jnp.mean(s[-1])))

  def chain_kernels(v, per_layer):
    def body(_, v):
      for l in range(L):
        v = next_v(v, layer_kernels(v, per_layer[l]))
      return v
    return jax.lax.fori_loop(0, args.steps, body, v)

  def chain_persistent(v, per_layer, *, poll, early, wait):
    def body(step, carry):
      v, cnts = carry
      out = []
      for l in range(L):
        s, c = layer_persistent(v, per_layer[l], step, cnts[l], poll=poll, early=early, wait=wait)
        v = next_v(v, s)
        out.append(c)
      return v, out
    return jax.lax.fori_loop(0, args.steps, body, (v, [jnp.zeros((1,), jnp.int32)] * L))[0]

  fns = {"kernels": jax.jit(chain_kernels)}
  for name, (poll, early, wait) in VARIANTS.items():
    fns[name] = jax.jit(functools.partial(chain_persistent, poll=poll, early=early, wait=wait))
  args_of = dict.fromkeys(fns, (v0, per_layer))
  mb = sum(r for _, r, _ in PHASES) * 128 * D * 2 / 1e6
  return chain_timing.compare_and_time(fns, args_of, "kernels", args, L, width=10, skip=lambda n: n == "nowait",
                                       megabytes=mb)

if __name__ == "__main__":
  main()
