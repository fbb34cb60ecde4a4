"""The backward of a kernel that has none of its own: the cotangents of its jnp reference."""
from __future__ import annotations

from typing import Callable

import jax


def with_reference_vjp(kernel: Callable, reference: Callable, *args):
  """kernel(*args), differentiated as reference(*args): d/dargs = vjp(reference, *args).

  For forward-only kernels (the decode kernels) that equal their reference; integer arguments get
  the reference's float0 cotangents. The residuals are the arguments themselves.
  """
  f = jax.custom_vjp(kernel)
  f.defvjp(lambda *a: (kernel(*a), a), lambda a, g: jax.vjp(reference, *a)[1](g))
  return f(*args)
