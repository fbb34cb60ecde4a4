"""Lets jax < 0.11's Mosaic GPU interpreter run wgmma on a transposed shared-memory operand.

The Hopper kernels feed wgmma `plgpu.transpose_ref(...)` views (the transposed weight of
dX = dH W^T, the transposed rows of dW = X^T dH), which compile on the GPU with every jax we
support, but jax 0.10's GPU interpreter reads wgmma operands through a helper that knows only
indexing transforms (AttributeError: 'TransposeTransform' object has no attribute 'indices').
jax 0.11 reads them properly. For older jax this replaces the interpreter's wgmma callback with
one that reads the operand through its indexers and then applies the transpose; the kernels
under test are unchanged. Nothing here runs on the GPU; outside the tests, only the --smoke runs
of experiments/bench_gmm_skew.py and ncu_gmm_kernels.py take it (tune_gmm.interpret_compat).

`compile_thread_bodies_once` is for speed only: the interpreter recompiles each kernel thread's
body on every call, and this compiles it once. It also hands the interpreter's host callbacks their
operands as numpy arrays (`_numpy_callback_operands`), again for speed only.
"""
from __future__ import annotations

import threading

import jax
import numpy as np


def install() -> None:
  if tuple(jax.__version_info__[:2]) >= (0, 11):
    return
  from jax._src.pallas.mosaic.interpret import utils as interpret_utils
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
  from jax._src.state import types as state_types

  if getattr(cb.wgmma, "sparsejax_compat", False):
    return
  original = cb.wgmma

  def split(transforms):
    """(indexers before the transpose, the transpose's permutation or None)."""
    for i, t in enumerate(transforms):
      if isinstance(t, state_types.TransposeTransform):
        if i != len(transforms) - 1:
          raise NotImplementedError("compat wgmma: indexing after a transpose")
        return transforms[:i], t.permutation
    return transforms, None

  def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array,
            acc_transforms, acc_dtype, a_allocation_key_as_array, a_transforms,
            b_allocation_key_as_array, b_transforms, source_info=None):
    a_tf = cb._remove_noop_transforms(a_transforms)
    b_tf = cb._remove_noop_transforms(b_transforms)
    if split(a_tf)[1] is None and split(b_tf)[1] is None:
      return original(
          token=token, device_id=device_id, grid_point_coords=grid_point_coords,
          thread_id=thread_id, acc_allocation_key_as_array=acc_allocation_key_as_array,
          acc_transforms=acc_transforms, acc_dtype=acc_dtype,
          a_allocation_key_as_array=a_allocation_key_as_array, a_transforms=a_transforms,
          b_allocation_key_as_array=b_allocation_key_as_array, b_transforms=b_transforms,
          source_info=source_info)
    device_id, thread_id = int(device_id), int(thread_id)
    shared_memory = cb._get_shared_memory()
    tid = shared_memory.get_global_thread_id(device_id, thread_id)
    info = interpret_utils.GPULoggingInfo(
        device_id=device_id, grid_point_coords=tuple(int(x) for x in grid_point_coords),
        thread_id=thread_id, source_info=source_info)

    def read(key_as_array, transforms):
      indexers, perm = split(transforms)
      key = cb.HostAllocationKey.from_array(key_as_array)
      rnge = interpret_utils.to_range(jax.tree.map(int, indexers))
      value, _, _ = shared_memory.get_buffer_content(key, rnge, tid, logging_info=info)
      return value if perm is None else np.transpose(value, perm)

    a, b = read(a_allocation_key_as_array, a_tf), read(b_allocation_key_as_array, b_tf)
    acc_key = cb.HostAllocationKey.from_array(acc_allocation_key_as_array)
    acc_range = interpret_utils.to_range(jax.tree.map(int, cb._remove_noop_transforms(acc_transforms)))
    acc, _, _ = shared_memory.get_buffer_content(acc_key, acc_range, tid, logging_info=info)
    shared_memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype),
                                       tid, logging_info=info)
    return token

  wgmma.sparsejax_compat = True
  cb.wgmma = wgmma


def compile_thread_bodies_once() -> None:
  """Makes the GPU interpreter compile each kernel thread's body once, not once per thread per call.

  The interpreter runs a kernel's warpgroups as threads, and each thread, on every call of the
  kernel, traces, lowers and compiles the same jaxpr (its body; the thread id is an argument) before
  running it: most of an interpreted kernel's time on two CPU cores. This keeps the compiled
  body per (jaxpr, operand shapes) and runs it in every thread. What runs is unchanged (the same
  jaxpr, compiled the same way, with the same arguments); only the repeated compiles go. Test speed
  only; without the private function it leaves the interpreter as it is.
  """
  _numpy_callback_operands()
  try:
    from jax._src.pallas.mosaic.interpret import thread_map
  except ImportError:
    return
  original = getattr(thread_map, "_run_jaxpr", None)
  if original is None or not hasattr(thread_map, "jax_core") or getattr(original, "sparsejax_compat", False):
    return
  compiled, lock = {}, threading.Lock()

  def body(jaxpr, consts, *args):
    thread_map.jax_core.eval_jaxpr(jaxpr, consts, *args)  # as the interpreter's own _run_jaxpr

  def run_jaxpr(jaxpr, consts, *args):
    avals = tuple((np.shape(a), str(getattr(a, "dtype", type(a)))) for a in jax.tree.leaves((consts, args)))
    with lock:
      entry = compiled.setdefault((jaxpr, avals), [threading.Lock(), None])
    with entry[0]:  # the other threads of the call wait for the first one's compile
      if entry[1] is None:
        entry[1] = jax.jit(body, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
    entry[1](consts, *args)

  run_jaxpr.sparsejax_compat = True
  thread_map._run_jaxpr = run_jaxpr


def _host_copy(a):
  """A numpy copy of a callback operand; an integer scalar as a Python int.

  jax 0.11's interpreter rebuilds its thread locations from the operands with a check that takes
  jax arrays and Python ints only (numpy scalars and 0-d arrays raise); the ids it reads are
  integer scalars, which jax 0.10's interpreter reads through int().
  """
  c = np.array(a)
  return int(c) if c.ndim == 0 and np.issubdtype(c.dtype, np.integer) else c


def _numpy_callback_operands() -> None:
  """Runs the GPU interpreter's io_callbacks on numpy copies of their operands.

  Each interpreted load, store, barrier and wgmma is a host callback, and jax's io_callback turns
  the callback's numpy operands into device arrays first (a device_put per call), which the
  interpreter's callbacks then read back one scalar at a time (int(device_id), ...): about 40% of an
  interpreted kernel's time. The interpreter's callbacks (and this module's wgmma) read their
  operands as values (int(), np.asarray, indexing), so numpy arrays serve them alike; they are
  copies, so nothing aliases XLA's buffers past the call. Every other io_callback takes jax's own
  path. Test speed only; without the private function it leaves io_callback as it is.
  """
  try:
    from jax._src import callback as jax_callback
    from jax._src import tree_util
  except ImportError:
    return
  original = getattr(jax_callback, "io_callback_impl", None)
  if original is None or getattr(original, "sparsejax_compat", False):
    return

  def interpreters(callback) -> bool:
    fn = getattr(callback, "callback_func", None)
    module = getattr(getattr(fn, "func", fn), "__module__", None) or ""
    return module.startswith("jax._src.pallas.mosaic_gpu.interpret") or module == __name__

  def io_callback_impl(*args, callback, **params):
    if not interpreters(callback):
      return original(*args, callback=callback, **params)
    return tree_util.tree_map(np.asarray, callback(*(_host_copy(a) for a in args)))

  io_callback_impl.sparsejax_compat = True
  jax_callback.io_callback_impl = io_callback_impl
