"""An early trigger for programmatic dependent launch (PDL) from a Pallas Triton kernel.

At one decode token a layer is a chain of short dependent kernels, and each boundary costs the next
kernel's launch and ramp on top of the bytes it reads (notes_decode.md). On Hopper XLA launches every
Pallas Triton kernel as a programmatic dependent of the kernel before it and puts a `griddepcontrol.wait`
at its very start (XLA's `xla_gpu_enable_pdl`; read from its sources in the twenty-ninth session). The
wait makes the dependent correct whenever it starts, but a primary that never executes
`griddepcontrol.launch_dependents` lets its dependents start only as its last block exits. A kernel that
triggers at its start lets the next one's blocks be scheduled and reach their wait while it runs, so at
the boundary only the wait's release remains. The trigger orders no memory: the wait still holds every
read of this kernel's output until the whole grid has finished and flushed.

`early(kernel, interpret, name)` wraps a kernel body so its programs trigger first, where EARLY names
the kernel. Measured in one-process A-Bs of the decode step on an H100 (notes_decode.md, thirty-third
session): the small kernels triggering (decode_qkv, the attention's chunks, the router's, the row FFN's
epilogue) took 2.9-3.0% off the medium- and xs-MoE steps; the weight-streaming products triggering too
made medium-moe's step 1.5-3.6% slower (xs-moe's 2-3% faster), so they do not; triggering after their
loop instead, before their stores, measured a tie (commit eb89293, reverted). Pallas Triton has no
instruction for the trigger, so it is a primitive of its own with a Triton lowering (inline assembly)
and a no-op discharge rule for interpret mode, where launch order means nothing. EARLY is read where a
kernel is traced, and shared_lowering keys its jit on it, so an A-B patch traces anew.
"""
from __future__ import annotations

import functools

from jax.experimental import pallas as pl
from jax._src import core as jax_core
from jax._src import state
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax._src.state import discharge as state_discharge

try:  # absent from a jax without Pallas' Triton backend (kernels.pallas_triton_available): no lowering to add then
  from jax._src.lib.triton import dialect as tt_dialect
  from jax._src.pallas.triton import lowering as triton_lowering
except ImportError:
  tt_dialect = triton_lowering = None

from sparsejax.kernels import gpu_compute_capability as _compute_capability

# Which kernels trigger: True (all), False (none) or a tuple of kernel names; read where a kernel body is traced
# for a GPU (the A-B switch). The products (sparsejax_skinny_matmul, sparsejax_row_ffn) measured slower with it.
EARLY: bool | tuple[str, ...] = ("sparsejax_decode_qkv", "sparsejax_decode_attention", "sparsejax_decode_router",
                                  "sparsejax_decode_router_select", "sparsejax_decode_router_logits",
                                  "sparsejax_row_ffn_epilogue", "sparsejax_group_rows")

launch_dependents_p = jax_core.Primitive("sparsejax_launch_dependents")
launch_dependents_p.multiple_results = True


@launch_dependents_p.def_effectful_abstract_eval
def _abstract_eval(ref):
  del ref
  # A write effect on a ref it never writes: jax drops an op without effects whose results nobody uses.
  return [], {state.WriteEffect(0)}


def _lowering(ctx, ref):
  del ctx, ref
  # Triton's inline assembly wants a tensor operand and result: a dummy, never read (pure=False keeps the op).
  i32 = ir.IntegerType.get_signless(32)
  vec = ir.RankedTensorType.get([32], i32)
  zeros = arith.constant(vec, ir.DenseElementsAttr.get_splat(vec, ir.IntegerAttr.get(i32, 0)))
  tt_dialect.elementwise_inline_asm([vec], "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;",
                                    constraints="=r,r", pure=False, packed_element=1, args=[zeros])
  return []


if triton_lowering is not None:
  triton_lowering.register_lowering(launch_dependents_p)(_lowering)


@state_discharge.register_discharge_rule(launch_dependents_p)
def _discharge(*args):
  del args  # (in_avals, out_avals, ref) on jax 0.10, (ctx, ref) on 0.11: either way the ref stays as it was
  return (None,), []


def triggers(name: str) -> bool:
  """Whether the kernel called `name` triggers early under EARLY. griddepcontrol is PTX for sm_90 and later, so a
  GPU before Hopper never triggers (its kernels launch as they always did)."""
  cc = _compute_capability()
  if cc is not None and int(str(cc).split(".")[0]) < 9:
    return False
  return EARLY if isinstance(EARLY, bool) else name in EARLY


def early(kernel, interpret: bool, name: str):
  """kernel, its programs first letting the next kernel in the stream launch, where `name` triggers (compiled
  only; interpret mode runs kernel as it is). The trigger is bound on the kernel's last ref, an output, which it
  does not touch."""
  if interpret or not triggers(name):
    return kernel

  @functools.wraps(kernel)
  def triggered(*refs, **kwargs):
    launch_dependents_p.bind(refs[-1])
    return kernel(*refs, **kwargs)

  return triggered


def pallas_call(kernel, *, name: str, interpret: bool, **kwargs):
  """pl.pallas_call of early(kernel, interpret, name): the decode kernels' launch."""
  return pl.pallas_call(early(kernel, interpret, name), name=name, interpret=interpret, **kwargs)
