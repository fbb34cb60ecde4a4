"""gather_rows' reference: XLA's filling gather."""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def gather_rows_reference(x: Float[Array, "n d"], src: Int[Array, "rows"]) -> Float[Array, "rows d"]:
  """out[r] = x[src[r]], zero where src[r] == n (a filling gather: no zero-padded copy of x)."""
  return jnp.take(x, src, axis=0, mode="fill", fill_value=0)
