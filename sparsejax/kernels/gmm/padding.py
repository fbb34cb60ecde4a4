"""Zero padding of operands up to whole tiles, shared by the backends (zeros add nothing to a product)."""
from __future__ import annotations

import jax.numpy as jnp


def pad_to(x, axis: int, multiple: int):
  """x with zeros appended along axis up to a multiple of `multiple` (x itself when it is one)."""
  pad = (-x.shape[axis]) % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)
