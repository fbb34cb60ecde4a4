"""Whole rows of d numbers as one Pallas Triton block, for kernels that fold an RMSNorm in or store a residual row.

Triton's blocks are powers of two. Where d is one, a row is the block ref[.., rows, 0:d]. Elsewhere (d 768) it is
the block of width(d) = the next power of two, its columns past d loaded as zeros and stored onto column d - 1
with its own value. Every address stays inside the row (the column index is clamped to d - 1), so no program
reads or writes past the buffer on the GPU, where Pallas Triton masks no block access of its own. A norm over
such a block divides its sum of squares by d, not by the width.

A kernel that holds a block per row of weights (the row FFN's slabs) would waste a quarter of its registers on
a padded block at d 768; it takes the row as pieces instead (pieces: 768 = 512 + 256), each a block of its own.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def width(d: int) -> int:
  """The block's columns for a row of d numbers: d rounded up to a power of two."""
  return pl.next_power_of_2(d)


def pieces(d: int) -> tuple[tuple[int, int], ...]:
  """d as (offset, size) blocks of powers of two, largest first, that tile 0..d: its binary digits."""
  out, offset = [], 0
  for bit in reversed(range(d.bit_length())):
    if d >> bit & 1:
      out.append((offset, 1 << bit))
      offset += 1 << bit
  return tuple(out)


def piece_index(d: int, piece: tuple[int, int]):
  """The index of a piece along an axis of d: the whole axis where the piece is all of it (so a power-of-two d
  lowers as it did before pieces), else the piece's static slice."""
  offset, size = piece
  return slice(None) if size == d else pl.ds(offset, size)


def _indices(lead: tuple, row0, nrows: int, d: int):
  shape = (nrows, width(d))
  cols = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  rows = row0 + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  # Every index an array: interpret mode takes no mix of arrays and slices.
  idx = tuple(jnp.full(shape, i, jnp.int32) for i in lead) + (rows, jnp.minimum(cols, d - 1))
  return idx, cols < d


def load(ref, row0, nrows: int, lead: tuple = ()) -> jax.Array:
  """ref[*lead, row0:row0 + nrows, :] as [nrows, width(d)], zero past column d."""
  d = ref.shape[-1]
  if width(d) == d:
    return ref[(*lead, pl.ds(row0, nrows), pl.ds(0, d))]
  from jax.experimental.pallas import triton as plt
  idx, inside = _indices(lead, row0, nrows, d)
  return plt.load(ref.at[idx], mask=inside, other=0)


def store(ref, row0, value: jax.Array) -> None:
  """ref[row0:row0 + rows, :] = value[:, :d], value a [rows, width(d)] block from load's layout."""
  d = ref.shape[-1]
  if width(d) == d:
    ref[pl.ds(row0, value.shape[0]), :] = value
    return
  from jax.experimental.pallas import triton as plt
  idx, inside = _indices((), row0, value.shape[0], d)
  # The padding columns' clamped index is column d - 1, so they store its value there too: every write to an
  # address carries the same number. A masked store instead leaves the order of the duplicates to the backend,
  # and interpret mode writes the old contents back through the masked ones.
  at_last = jax.lax.broadcasted_iota(jnp.int32, value.shape, 1) == d - 1
  last = jnp.sum(jnp.where(at_last, value, jnp.zeros((), value.dtype)), axis=1, keepdims=True)
  plt.store(ref.at[idx], jnp.where(inside, value, last.astype(value.dtype)))


def mean_square(x: jax.Array, d: int) -> jax.Array:
  """[rows, 1] float32: the mean of x^2 over a row's d numbers (the block's padding columns are zeros)."""
  x32 = x.astype(jnp.float32)
  if x.shape[-1] == d:
    return jnp.mean(x32 * x32, axis=1, keepdims=True)
  return jnp.sum(x32 * x32, axis=1, keepdims=True) / d
