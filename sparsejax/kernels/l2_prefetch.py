"""An L2 prefetch issued from inside a Pallas Triton kernel: fire and forget, no registers, no wait.

At one decode token a layer is a chain of small kernels whose DRAM bandwidth sits idle for most of their
time, while each weight-streaming kernel pays the latency of its first loads. A product whose weight is
already in L2 runs faster (the qkv product 3.4-3.7 us against 4.7-4.8 on an H100; notes_decode.md,
twenty-first session), but a separate prefetch kernel held SM slots and bandwidth and cost more than it
saved. Here a kernel that runs anyway issues `prefetch.global.L2::evict_last` for lines of an array a later
kernel reads: each thread issues its instructions and moves on, so the kernel's own chain is unchanged.

Pallas Triton has no prefetch and no way to take a ref's address into inline assembly, so `prefetch_lines`
is a primitive of its own with a Triton lowering (the ref's pointer plus element offsets, one inline-asm
prefetch per offset) and, for interpret mode, a discharge rule that does nothing: a prefetch changes no
value, so off the GPU it is a no-op and the kernel's results are those of the kernel without it.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax._src import core as jax_core
from jax._src import state
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.state import discharge as state_discharge
from jaxtyping import Array, Int

# An L2 line (four 32-byte sectors): one prefetch instruction brings one.
LINE_BYTES = 128

prefetch_lines_p = jax_core.Primitive("sparsejax_prefetch_l2_lines")
prefetch_lines_p.multiple_results = True


@prefetch_lines_p.def_effectful_abstract_eval
def _abstract_eval(ref, offsets):
  del offsets
  # A write effect, though it writes nothing: jax drops an op whose only effect is a read and whose results
  # nobody uses.
  return [], {state.WriteEffect(0)}


@triton_lowering.register_lowering(prefetch_lines_p)
def _lowering(ctx, ptr, offsets):
  # ptr: the ref's root pointer (a scalar !tt.ptr); offsets: an i32 tensor of element offsets from it.
  shape = ir.RankedTensorType(offsets.type).shape
  ptrs = tt_dialect.addptr(
      ir.RankedTensorType.get(shape, ptr.type), tt_dialect.splat(ir.RankedTensorType.get(shape, ptr.type), ptr),
      offsets)
  # Triton wants a tensor result beside tensor operands: a dummy zero, never read (pure=False keeps the op).
  tt_dialect.elementwise_inline_asm([ir.RankedTensorType.get(shape, ir.IntegerType.get_signless(32))],
                                    "prefetch.global.L2::evict_last [$1];\n\tmov.b32 $0, 0;", constraints="=r,l",
                                    pure=False, packed_element=1, args=[ptrs])
  return []


@state_discharge.register_discharge_rule(prefetch_lines_p)
def _discharge(in_avals, out_avals, ref, offsets):
  del in_avals, out_avals, offsets
  return (None, None), []


def prefetch_lines(ref, offsets: Int[Array, "n"]) -> None:
  """Ask L2 for the lines holding ref.flat[offsets] (element offsets into the whole ref; a kernel operand whose
  BlockSpec is the whole array). A hint: nothing waits on it, and interpret mode skips it."""
  prefetch_lines_p.bind(ref, offsets.astype(jnp.int32))


def prefetch_share(ref, program, programs: int) -> None:
  """Program `program` of `programs` asks L2 for its share of the whole of ref: a power-of-two count of lines
  each (a Triton block), so the first ceil(lines(ref) / that) programs ask and the last one's offsets past the
  end are clamped onto ref's last element."""
  itemsize = jnp.dtype(ref.dtype).itemsize
  size = 1
  for n in ref.shape:
    size *= n
  total = -(-size * itemsize // LINE_BYTES)
  lines = lines_per_program(total, programs)
  per_line = LINE_BYTES // itemsize

  @pl.when(program * lines < total)
  def _():
    offsets = (program * lines + jnp.arange(lines, dtype=jnp.int32)) * per_line
    prefetch_lines(ref, jnp.minimum(offsets, size - 1))


def lines_per_program(total: int, programs: int) -> int:
  """The lines each program asks for so that `programs` cover `total` lines: ceil(total / programs) rounded up to
  a power of two."""
  need = -(-total // programs)
  return 1 << (need - 1).bit_length()
