"""One lowering per program for a kernel that many layers call alike.

jax traces and lowers a pallas_call wherever it is called, so a model of L layers lowers each of its
kernels L times. For Mosaic GPU that also meant L compiles: its compile cache keys on the module's
hash, and jaxlib 0.11 stamps every lowering with a process-unique name (mosaic_gpu.dump_basename), so
no two call sites matched (about 0.7 s a kernel on an H100; the medium-moe prefill spent 15 s lowering
and 40 s compiling 48 kernels). A nested jax.jit is traced and lowered once per program for each
distinct set of static arguments and argument shapes, and XLA inlines it: the layers share one module,
each distinct kernel compiles once, and the kernels run as before.

The jit also keys on the kernels' module switches (`module_switches`: launch_dependents.EARLY,
skinny_matmul.triton.INT8_FLOAT_BITS, and the row FFN's slab widths, warps and the wave it narrows its slabs
to fill): an A-B that patches one traces B's kernels anew instead of being handed A's.

Interpret mode (the CPU tests) calls the kernel directly: jax 0.10's Mosaic GPU interpreter, whose
callbacks dispatch jax ops, ran one CPU test in minutes inside a jit against 18 s outside it. The
Triton kernels follow the same rule, so interpret mode runs every kernel as it did before.
"""
from __future__ import annotations

import functools
import inspect

import jax

from sparsejax.kernels import launch_dependents
from sparsejax.kernels.pallas_triton_gpu import register_device_gpu


def module_switches() -> tuple:
  """Module switches a kernel's trace reads (A-B flags): part of the jit's key, so a patched switch traces anew
  where the nested jit would otherwise hand back the kernel traced and lowered before the patch."""
  from sparsejax.kernels.skinny_matmul import triton as skinny, triton_row_ffn as row  # they import this module

  return (launch_dependents.EARLY, skinny.INT8_FLOAT_BITS, row.SLAB_ROW_BYTES, row.SLAB_ROW_BYTES_INT8, row.NUM_WARPS,
          row.WAVE_PROGRAMS, row.MIN_SLAB_COLUMNS)


def shared_lowering(*static_argnames: str):
  """Decorator: fn under jax.jit with these arguments (and `interpret`, if fn takes it) static, or
  fn itself when called with interpret=True. Static arguments must be hashable (ints, dtypes, frozen
  configs, functions); everything else is traced."""

  def decorate(fn):
    names = static_argnames + (("interpret",) if "interpret" in inspect.signature(fn).parameters else ())

    def keyed(*args, _switches, **kwargs):
      return fn(*args, **kwargs)

    # fn's signature plus the switches, so that jit finds static arguments passed by position
    sig = inspect.signature(fn)
    keyed.__signature__ = sig.replace(parameters=[*sig.parameters.values(), inspect.Parameter(
        "_switches", inspect.Parameter.KEYWORD_ONLY)])
    jitted = jax.jit(keyed, static_argnames=names + ("_switches",))

    @functools.wraps(fn)
    def call(*args, **kwargs):
      if kwargs.get("interpret", False):
        return fn(*args, **kwargs)
      register_device_gpu()  # a GPU jax 0.11's Pallas Triton table lacks lowers by its own capability
      return jitted(*args, _switches=module_switches(), **kwargs)

    return call

  return decorate


def call_shared(kernel, *args, dynamic: dict | None = None, cache_key=(), **static):
  """kernel(*args, **dynamic, **static) under a jax.jit whose static arguments are the kernel,
  `static` (hashable) and cache_key (anything else the kernel's trace depends on, e.g. the SM count
  it reads itself). dynamic: keyword arguments that are arrays (or None)."""
  return _call(args, dynamic or {}, kernel=kernel, static=tuple(sorted(static.items())), cache_key=cache_key)


@functools.partial(jax.jit, static_argnames=("kernel", "static", "cache_key"))
def _call(args, dynamic, *, kernel, static, cache_key):
  del cache_key  # part of the jit's cache key only
  return kernel(*args, **dynamic, **dict(static))
