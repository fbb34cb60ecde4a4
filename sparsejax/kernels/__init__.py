"""GPU kernels, one folder per op (contract + reference, one file per backend)."""
import functools
import warnings

import jax


def gpu_compute_capability() -> str | None:
  """The GPU's compute capability ("9.0"), or None off the GPU (interpret mode, or a CPU lowering for CUDA)."""
  if jax.default_backend() != "gpu":
    return None
  return getattr(jax.devices()[0], "compute_capability", None)


@functools.cache
def pallas_triton_available() -> bool:
  """Whether this jax has Pallas' Triton backend (jax.experimental.pallas.triton). JAX 0.11 deprecated it for
  removal; where it is gone, "auto" runs the XLA paths instead of the Triton kernels (auto_takes_triton)."""
  try:
    import jax.experimental.pallas.triton  # noqa: F401
  except ImportError:
    return False
  return True


def auto_takes_triton() -> bool:
  """For an "auto" choice that would run a Pallas Triton kernel: whether it can (pallas_triton_available). Where it
  cannot on a GPU, warns once per process that the XLA path runs instead."""
  if pallas_triton_available():
    return True
  if jax.default_backend() == "gpu":
    _warn_no_triton()
  return False


@functools.cache
def _warn_no_triton() -> None:
  warnings.warn(f"jax {jax.__version__} has no Pallas Triton backend: sparsejax's Triton kernels are unavailable, "
                "so their XLA paths run instead (slower).", RuntimeWarning, stacklevel=4)


def require_triton(op: str, instead: str = "impl='auto' or impl='xla'") -> None:
  """Raises (one line, at trace time) where an explicit Triton impl asks for the backend this jax lacks."""
  if not pallas_triton_available():
    raise RuntimeError(f"{op} runs Pallas Triton kernels, but jax {jax.__version__} has no Pallas Triton backend; "
                       f"use {instead}.")
