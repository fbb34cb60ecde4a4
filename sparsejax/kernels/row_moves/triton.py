"""gather_rows as a Pallas Triton kernel: the MoE layer's forward row gather x -> expert buffer.

  out[r] = x[src[r]], 0 where src[r] == len(x)

XLA:GPU fuses `take(x, src, mode="fill")` into a loop fusion whose threads each move one element
through a gathered index: 1.46 TB/s at E64 top-8's 73,728 x 2048 buffer on an H100, against 2.65 TB/s
for this kernel, which moves a [block_rows, block_d] tile per program with one index per row and
each row segment in vectors (experiments/results/row_moves_probe_H100.log). The layer's other three
row moves (the combine, both transposes) XLA already runs at 2.9-3.3 TB/s, so they stay XLA's.
Reference: reference.py. Off the GPU the kernel runs in Pallas' interpret mode (tests).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from sparsejax.kernels.shared_lowering import shared_lowering


@dataclasses.dataclass(frozen=True)
class Config:
  """A program moves block_rows rows x block_d columns (powers of two). 64 x 128 was the best or
  within 3% of it of the four tried at E64 top-1, E8 top-2 and E64 top-8 (the probe above)."""
  block_rows: int = 64
  block_d: int = 128
  num_warps: int = 4


def block_d_for(d: int, cfg: Config = Config()) -> int | None:
  """The column block for width d: cfg.block_d, or d itself when smaller and a power of two; None when
  neither divides d (the kernel does not take that width). group_rows' kernel takes its columns by the same
  rule, with its own config's block_d."""
  bd = min(cfg.block_d, d)
  return bd if bd & (bd - 1) == 0 and d % bd == 0 else None


def _kernel(src_ref, x_ref, out_ref, *, n: int, r: int, block_d: int):
  from jax.experimental.pallas import triton as plt
  # The last program's block may run past the r rows. Pallas Triton masks no block access, so its src reads and
  # stores are masked here: unmasked, its stores wrote past the output into whatever buffer lay beyond it (a
  # capacity layer's E x C rows, C not a multiple of block_rows, zeroed its router weights on an H100). Interpret
  # mode drops such writes, so only a GPU run shows them.
  block_rows = out_ref.shape[0]
  inside = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows,), 0) < r
  idx = plt.load(src_ref, mask=inside, other=n)
  valid = (idx >= 0) & (idx < n)  # never an address outside x, whatever src holds
  rows = jnp.where(valid, idx, 0)[:, None]
  cols = pl.program_id(1) * block_d + jax.lax.broadcasted_iota(jnp.int32, (1, block_d), 1)
  # Both indices as arrays (interpret mode takes no mix of arrays and slices); Triton still sees
  # contiguous columns and moves them in vectors.
  mask = jnp.broadcast_to(valid[:, None], out_ref.shape)
  plt.store(out_ref, plt.load(x_ref.at[rows, cols], mask=mask, other=0),
            mask=jnp.broadcast_to(inside[:, None], out_ref.shape))


@shared_lowering("cfg")
def gather_rows(
    x: Float[Array, "n d"], src: Int[Array, "rows"], cfg: Config = Config(), *, interpret: bool = False
) -> Float[Array, "rows d"]:
  """out[r] = x[src[r]], zero where src[r] == n; src in [0, n]; block_d_for(d) is not None."""
  r, (n, d) = src.shape[0], x.shape
  bd = block_d_for(d, cfg)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1)
  return pl.pallas_call(
      functools.partial(_kernel, n=n, r=r, block_d=bd),
      grid=(pl.cdiv(r, cfg.block_rows), d // bd),
      in_specs=[pl.BlockSpec((cfg.block_rows,), lambda i, j: (i,)), pl.no_block_spec],
      out_specs=pl.BlockSpec((cfg.block_rows, bd), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((r, d), x.dtype),
      interpret=interpret, compiler_params=params, name="sparsejax_gather_rows",
  )(src, x)
