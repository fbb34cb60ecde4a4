"""The persistent decode layer's ceiling with copies decoupled from program order: Mosaic GPU, TMA and semaphores.

probe_persistent_layer.py found a persistent Pallas Triton kernel latency-bound phase by phase, before any
synchronisation (20.4 us of device time for a layer-shaped 29.4 MB, 10.1 us of bytes): a Triton program's loads
follow its fences. A megakernel streams its weights with copies that run beside the program: TMA copies into
shared memory, issued ahead and waited on only where a phase needs them. This probe measures that design's
ceiling in Mosaic GPU with no arithmetic at all, so what it reports is the streaming plus the grid barriers:

  per CTA (P = 128, one warpgroup each): a dependency tile from the previous layer's output, then the phases of
  probe_persistent_layer.PHASES; a phase waits for its slab's copies (if it has one), then a grid barrier.
  The expert's slab is copied only after the router's barrier (it depends on the router). At the end each CTA
  stores its expert slab's first 256 rows, so the output proves every copy landed.

  early       the data-independent slabs (qkv, the KV cache, W_o) copied at the kernel's start
  late        each slab copied only after the barrier before its phase (a kernel per phase, in effect)
  *_gpu       the same, each barrier's signal released at GPU scope (pl.semaphore_signal releases at system scope)
  nobarrier   early, with no grid barriers (the streaming alone; the CTAs still wait for their own copies)

and a step's every layer in one kernel (GPU-scope barriers, one more a layer for the boundary the kernels had):

  step_next       the next layer's qkv, KV and W_o slabs copied right after this layer's W_o phase, so they
                  stream beside the router's barrier and the expert's slab (the expert has boxes of its own)
  step_late       the next layer's slabs copied only after this layer's last barrier
  step_nobarrier  step_next with no grid barriers

Grid barrier k is a global semaphore of its own (pl.get_global; Mosaic GPU zeroes its GMEM scratch for every
call): every CTA signals it, then polls it until it reads P.

Interpret mode runs blocks one after another and has no global semaphores, so the CPU test interprets the two
variants without grid barriers (their copies and the copies' barriers, the step's over two layers) and lowers
every variant for CUDA; the GPU run checks each variant's output against the slabs it copied.

Measured on an H100 (us a layer; a chain of 50 x 24 with XLA's command buffers on / the kernel's device time traced
with them off; results/persistent_layer_mgpu{,_gpu_scope}_H100.log):

  nobarrier 14.4-14.6 / 12.5-12.6; early 24.2-24.4 / 21.9-22.0; late 25.3; early_gpu 21.0 / 18.2; late_gpu 21.9 / 19.0

The first barrier form (a pair of semaphores a barrier, counts taken back by decrementing waits, a CAS loop all
CTAs contend for) ran 234.8 us a layer (results/persistent_layer_mgpu_cas_H100.log). So the streaming decouples
(12.5 us of device time for 10.1 us of bytes), but each grid barrier costs 1.6 us with pl.semaphore_signal's
system-scope release and 0.94 us with a GPU-scope one, and copying the data-independent slabs early saves
0.8-0.9 us of the 6 barriers' wait. Before any arithmetic, the best form needs 18.2 us of device time for a layer
whose bytes take 10.1 (1.8x); the Pallas Triton kernel per phase, with its arithmetic, runs 27.2-27.4
(probe_persistent_layer.py).

The step kernel (results/persistent_step_mgpu_H100.log, same units): step_next 17.28 / 16.30, step_late 17.48 /
16.47, step_nobarrier 10.46 / 9.61, against early_gpu 21.03 / 18.06 in the same run. One kernel a step streams at
the copy bandwidth and pays ~0.96 us a barrier (7 a layer); the next layer's early copies save 0.2 us, since the
expert's stream waits on the router's barrier. With no arithmetic, 1.6x the bytes' time.

GPU:  python experiments/probe_persistent_layer_mgpu.py [--layers 24 --steps 50 --rounds 7]
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax import tree_util
from jax._src import core as jax_core
from jax._src.pallas import primitives as pallas_primitives
from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering
from jax.experimental.mosaic import gpu as mgpu

import chain_timing
from probe_persistent_layer import D, HEAVY, PHASES

COLS = 64                  # a copy's rows are 128 bytes of bf16
BOX = 256                  # rows a TMA copy (32 KB)
ROWS = {i: PHASES[i][1] * D // COLS for i in HEAVY}   # a CTA's slab of phase i as [ROWS, COLS]
# name: (data-independent slabs copied at the start, the barriers' signal: "sys", "gpu" or None for no barriers)
VARIANTS = {"early": (True, "sys"), "late": (False, "sys"), "early_gpu": (True, "gpu"), "late_gpu": (False, "gpu"),
            "nobarrier": (True, None)}

signal_gpu_p = jax_core.Primitive("probe_semaphore_signal_gpu")
signal_gpu_p.multiple_results = True


def signal_gpu(sem) -> None:
  """+1 on a semaphore, released at GPU scope by one lane after a warpgroup barrier. pl.semaphore_signal releases
  at system scope (a relaxed add, then fence.release.sys), which a barrier inside one GPU does not need."""
  ref, transforms = pallas_primitives._get_ref_and_transforms(sem)
  flat, tree = tree_util.tree_flatten([ref, transforms])
  signal_gpu_p.bind(*flat, args_tree=tree)


@signal_gpu_p.def_effectful_abstract_eval
def _signal_gpu_abstract_eval(*avals, args_tree):
  del avals, args_tree
  return [], {pallas_primitives.sem_effect}


@mgpu_lowering.register_lowering_rule(signal_gpu_p, mgpu.LoweringSemantics.Warpgroup)
def _signal_gpu_lowering(ctx, *args, args_tree):
  sem, transforms = tree_util.tree_unflatten(args_tree, args)
  sem_aval, transform_avals = tree_util.tree_unflatten(args_tree, ctx.avals_in)
  sem, _, transforms = mgpu_lowering._handle_transforms(ctx, sem_aval, sem, transform_avals, transforms)
  assert not transforms, transforms
  with mgpu_lowering._wrap_in_custom_primitive_if_wg(ctx, [sem]) as [sem]:
    mgpu.utils.warpgroup_barrier()  # every thread's accesses before the one lane's release
    mgpu.utils.SemaphoreRef(mgpu.utils.memref_ptr(sem)).signal(
        1, predicate=ctx.module_ctx.single_wg_lane_predicate, memory_scope="gpu")
  return ()



def _transforms():
  return (plgpu.TilingTransform((8, COLS)), plgpu.SwizzleTransform(128))


def _body(dep, *refs, early, scope):
  """refs: each heavy phase's slabs [P, ROWS, COLS], then out [P, BOX, COLS]."""
  *slabs, out = refs
  slab_of = dict(zip(HEAVY, slabs))
  p = lax.axis_index("x")
  num = slabs[0].shape[0]
  expert = next(i for i in HEAVY if not PHASES[i][2])
  # buffers: the qkv slab's two boxes, the KV cache's and W_o's halves of a box, one more box; the expert's four
  # boxes reuse the qkv boxes, the KV cache's and the spare one (nothing reads a buffer once its phase is past)
  buf_of = {}
  next_buf = 0
  for i in HEAVY:
    if i == expert:
      continue
    buf_of[i] = list(range(next_buf, next_buf + -(-ROWS[i] // BOX)))
    next_buf += len(buf_of[i])
  spare = next_buf
  buf_of[expert] = buf_of[HEAVY[0]] + [buf_of[HEAVY[1]][0], spare]
  assert len(buf_of[expert]) * BOX == ROWS[expert], ROWS

  def scoped(bufs, dep_smem, dep_ready, *ready):  # ready[k]: heavy phase k's barrier, one arrival a copy
    # A semaphore a barrier, zeroed for every call by Mosaic GPU, so the count needs neither an epoch nor a reset.
    # (A first form took the counts back with decrementing waits, a CAS loop that 128 CTAs contend for: 37 us a
    # barrier, results/persistent_layer_mgpu_cas_H100.log.)
    sems = [pl.get_global(plgpu.SemaphoreType.REGULAR) for _ in range(len(PHASES) - 1)] if scope else []

    def barrier(k):
      if scope:
        (signal_gpu if scope == "gpu" else pl.semaphore_signal)(sems[k])
        plgpu.semaphore_wait(sems[k], num, decrement=False, memory_scope="gpu")

    def issue(i):  # phase i's slab: one TMA copy a box, each onto the phase's barrier
      for j, b in enumerate(buf_of[i]):
        rows = min(BOX, ROWS[i] - j * BOX)
        plgpu.copy_gmem_to_smem(slab_of[i].at[p, pl.ds(j * BOX, rows)], bufs.at[b, pl.ds(0, rows)],
                                ready[HEAVY.index(i)])

    plgpu.copy_gmem_to_smem(dep, dep_smem, dep_ready)  # the previous layer's output: the chain's dependence
    plgpu.barrier_wait(dep_ready)
    for i in HEAVY:
      if i == HEAVY[0] or (early and PHASES[i][2]):
        issue(i)
    for i, (_, rows, loads_early) in enumerate(PHASES):
      if rows:
        if not (i == HEAVY[0] or (early and loads_early)):
          issue(i)
        plgpu.barrier_wait(ready[HEAVY.index(i)])
      if i < len(PHASES) - 1:
        barrier(i)
    plgpu.copy_smem_to_gmem(bufs.at[buf_of[expert][0]], out.at[p])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(scoped,
                plgpu.SMEM((spare + 1, BOX, COLS), jnp.bfloat16, transforms=_transforms()),
                plgpu.SMEM(dep.shape, jnp.bfloat16, transforms=_transforms()),
                plgpu.Barrier(num_arrivals=1),
                *[plgpu.Barrier(num_arrivals=len(buf_of[i])) for i in HEAVY])


STEP_VARIANTS = {"step_next": (True, "gpu"), "step_late": (False, "gpu"), "step_nobarrier": (True, None)}


def _step_body(dep, *refs, prefetch_next, scope):
  """Every layer of a step in one kernel. refs: each heavy phase's slabs [L, P, ROWS, COLS], then out [P, BOX, COLS]
  (the last layer's expert slab's first rows). A grid barrier follows every phase but the last layer's last."""
  *slabs, out = refs
  qkv, att, w_o, exp = slabs
  layers, num = qkv.shape[0], qkv.shape[1]
  p = lax.axis_index("x")
  assert (ROWS[HEAVY[0]], ROWS[HEAVY[1]], ROWS[HEAVY[2]], ROWS[HEAVY[3]]) == (2 * BOX, BOX // 2, BOX // 2, 4 * BOX)

  def scoped(bufs, dep_smem, dep_ready, qkv_ready, att_ready, w_o_ready, exp_ready):
    # boxes 0-1 the qkv slab, box 2 the KV cache's (rows 0-127) and W_o's (128-255) slabs, boxes 3-6 the expert's:
    # the next layer's qkv, KV and W_o can land while this layer's expert streams
    count = layers * len(PHASES) - 1
    sems = [pl.get_global(plgpu.SemaphoreType.REGULAR) for _ in range(count)] if scope else []

    def barrier(k):
      if scope:
        (signal_gpu if scope == "gpu" else pl.semaphore_signal)(sems[k])
        plgpu.semaphore_wait(sems[k], num, decrement=False, memory_scope="gpu")

    def issue_light(l):  # layer l's data-independent slabs
      for j in range(2):
        plgpu.copy_gmem_to_smem(qkv.at[l, p, pl.ds(j * BOX, BOX)], bufs.at[j], qkv_ready)
      half = BOX // 2
      plgpu.copy_gmem_to_smem(att.at[l, p], bufs.at[2, pl.ds(0, half)], att_ready)
      plgpu.copy_gmem_to_smem(w_o.at[l, p], bufs.at[2, pl.ds(half, half)], w_o_ready)

    plgpu.copy_gmem_to_smem(dep, dep_smem, dep_ready)
    plgpu.barrier_wait(dep_ready)
    issue_light(0)
    k = 0
    for l in range(layers):
      for i, (name, _, _) in enumerate(PHASES):
        if name == "qkv":
          plgpu.barrier_wait(qkv_ready)
        elif name == "attention":
          plgpu.barrier_wait(att_ready)
        elif name == "w_o":
          plgpu.barrier_wait(w_o_ready)
          if prefetch_next and l + 1 < layers:
            issue_light(l + 1)
        elif name == "expert":
          for j in range(4):
            plgpu.copy_gmem_to_smem(exp.at[l, p, pl.ds(j * BOX, BOX)], bufs.at[3 + j], exp_ready)
          plgpu.barrier_wait(exp_ready)
        if k < count:
          barrier(k)
          k += 1
      if not prefetch_next and l + 1 < layers:
        issue_light(l + 1)
    plgpu.copy_smem_to_gmem(bufs.at[3], out.at[p])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(scoped,
                plgpu.SMEM((7, BOX, COLS), jnp.bfloat16, transforms=_transforms()),
                plgpu.SMEM(dep.shape, jnp.bfloat16, transforms=_transforms()),
                plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=1),
                plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=4))


@functools.partial(jax.jit, static_argnames=("prefetch_next", "scope", "interpret"))
def step_mgpu(dep, stacked, *, prefetch_next=True, scope="gpu", interpret=None):
  """[P, BOX, COLS] bf16: the last layer's expert slab's first BOX rows, after every layer's phases in one kernel
  (stacked: each heavy phase's slabs of every layer, [L, P, ROWS, COLS])."""
  body = functools.partial(_step_body, prefetch_next=prefetch_next, scope=scope)
  return _launch(body, "probe_persistent_step_mgpu", stacked[0].shape[1], interpret, dep, *stacked)


def _launch(body, name: str, num: int, interpret, *args):
  """body as a Mosaic GPU kernel of num CTAs, one warpgroup each, writing [num, BOX, COLS] bf16 (interpret: None for
  GPU interpret mode off the GPU, False to compile, e.g. to lower for CUDA on a CPU)."""
  body.__name__ = name
  if interpret is None and jax.default_backend() != "gpu":
    from sparsejax.kernels.gmm.mosaic import _interpret
    interpret = _interpret()
  else:
    interpret = None
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((num, BOX, COLS), jnp.bfloat16), grid=(num,),
                      grid_names=("x",),
                      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                      interpret=interpret)(*args)


@functools.partial(jax.jit, static_argnames=("early", "scope", "interpret"))
def layer_mgpu(dep, slabs, *, early=True, scope="sys", interpret=None):
  """[P, BOX, COLS] bf16: every CTA's expert slab's first BOX rows, after the layer's phases (interpret as _launch)."""
  body = functools.partial(_body, early=early, scope=scope)
  return _launch(body, "probe_persistent_layer_mgpu", slabs[0].shape[0], interpret, dep, *slabs)


def inputs(key, num: int, layers: int):
  """The dependency tile [8, COLS] and, per layer, the heavy phases' slabs as [P, ROWS, COLS] bf16."""
  keys = jax.random.split(key, layers + 1)
  dep = jax.random.normal(keys[0], (8, COLS), jnp.float32).astype(jnp.bfloat16)
  per_layer = [tuple(jax.random.normal(k, (num, ROWS[i], COLS), jnp.float32).astype(jnp.bfloat16)
                     for k, i in zip(jax.random.split(keys[l + 1], len(HEAVY)), HEAVY)) for l in range(layers)]
  return dep, per_layer


def check(variants=tuple(VARIANTS), num: int = 128) -> dict:
  """Largest |out - the expert slab's first rows| of each variant over three calls: every copy landed, and no call
  hung on its barriers."""
  dep, (slabs,) = inputs(jax.random.key(0), num, 1)
  want = np.asarray(slabs[-1][:, :BOX].astype(jnp.float32))
  errs = {}
  stacked = tuple(jnp.stack([w] * 2) for w in slabs)  # two layers; the second's expert slab is the one stored
  for name in [n for n in variants if n in STEP_VARIANTS]:
    prefetch_next, scope = STEP_VARIANTS[name]
    errs[name] = max(float(np.max(np.abs(np.asarray(step_mgpu(dep, stacked, prefetch_next=prefetch_next, scope=scope)
                                                     .astype(jnp.float32)) - want))) for _ in range(3))
  for name in [n for n in variants if n in VARIANTS]:
    early, scope = VARIANTS[name]
    errs[name] = max(float(np.max(np.abs(np.asarray(layer_mgpu(dep, slabs, early=early, scope=scope)
                                                     .astype(jnp.float32)) - want))) for _ in range(3))
  return errs


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  chain_timing.add_chain_args(ap)
  every = (*VARIANTS, *STEP_VARIANTS)
  ap.add_argument("--variants", default=",".join(every), help="comma-separated, of " + ", ".join(every))
  ap.set_defaults(steps=50)
  args = ap.parse_args(argv)
  variants = args.variants.split(",")
  if jax.default_backend() != "gpu":
    raise SystemExit("probe_persistent_layer_mgpu needs a GPU: its grid barriers cannot run in interpret mode")
  for name, err in check(variants).items():
    print(f"{name:>10}: max |out - the slab it copied| over three calls {err:.3g}")
  L = args.layers
  dep0, per_layer = inputs(jax.random.key(1), 128, L)

  def chain(dep, per_layer, *, early, scope):
    def body(_, dep):
      for l in range(L):
        out = layer_mgpu(dep, per_layer[l], early=early, scope=scope)
        dep = (out[0, :8] * 0.5).astype(dep.dtype)
      return dep
    return jax.lax.fori_loop(0, args.steps, body, dep)

  def chain_step(dep, stacked, *, prefetch_next, scope):
    def body(_, dep):
      out = step_mgpu(dep, stacked, prefetch_next=prefetch_next, scope=scope)
      return (out[0, :8] * 0.5).astype(dep.dtype)
    return jax.lax.fori_loop(0, args.steps, body, dep)

  fns, args_of = {}, {}
  stacked = None
  for n in variants:
    if n in STEP_VARIANTS:
      if stacked is None:
        stacked = tuple(jnp.stack([w[k] for w in per_layer]) for k in range(len(HEAVY)))
      prefetch_next, scope = STEP_VARIANTS[n]
      fns[n] = jax.jit(functools.partial(chain_step, prefetch_next=prefetch_next, scope=scope))
      args_of[n] = (dep0, stacked)
    else:
      fns[n] = jax.jit(functools.partial(chain, early=VARIANTS[n][0], scope=VARIANTS[n][1]))
      args_of[n] = (dep0, per_layer)
  mb = sum(ROWS.values()) * 128 * COLS * 2 / 1e6
  return chain_timing.compare_and_time(fns, args_of, variants[0], args, L, width=10, megabytes=mb)

if __name__ == "__main__":
  main()
