"""GPU kernels, one folder per op (contract + reference, one file per backend)."""
import functools
import warnings

import jax

from sparsejax.kernels import pallas_triton_gpu


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


# The Triton kernels are written for bf16 tensor cores (sm_80 and later; compiled and tested on sm_90 only).
MIN_TRITON_COMPUTE_CAPABILITY = (8, 0)


def gpu_capability_version() -> tuple[int, int] | None:
  """gpu_compute_capability as (major, minor), e.g. (9, 0); None off the GPU or for a string this code does not
  read (then the callers keep their defaults)."""
  cc = gpu_compute_capability()
  try:
    return None if cc is None else tuple(int(p) for p in str(cc).split(".")[:2])
  except ValueError:
    return None


# The most shared memory one block may use (the opt-in maximum, KiB) by compute capability (CUDA C++ Programming
# Guide, "Technical Specifications per Compute Capability"). Triton stops with "out of resource: shared memory"
# where a kernel's pipeline asks for more; the Triton kernels' tiles are an H100's (227 KiB).
SHARED_MEMORY_KIB = {(7, 0): 96, (7, 5): 64, (8, 0): 163, (8, 6): 99, (8, 7): 163, (8, 9): 99, (9, 0): 227,
                     (10, 0): 227, (10, 3): 227, (12, 0): 99, (12, 1): 99}


def shared_memory_limit() -> int | None:
  """Bytes of shared memory a block may use on this GPU; None off the GPU (interpret mode has no limit). A
  capability missing from the table gets the least of sm_80 and later (99 KiB): smaller tiles, never a failure."""
  if gpu_compute_capability() is None:
    return None
  return SHARED_MEMORY_KIB.get(gpu_capability_version(), 99) * 1024


def gpu_before_ampere() -> bool:
  """Whether the default device is a GPU older than sm_80 (T4, V100): no bf16 tensor cores."""
  version = gpu_capability_version()
  return version is not None and version < MIN_TRITON_COMPUTE_CAPABILITY


def auto_takes_triton() -> bool:
  """For an "auto" choice that would run a Pallas Triton kernel: whether it can, i.e. this jax has the backend
  (pallas_triton_available), the GPU is sm_80 or later, and Pallas Triton can lower for it
  (pallas_triton_gpu.unknown_device_gpu). Where it cannot on a GPU, warns once per process that the XLA path runs instead."""
  if gpu_before_ampere():
    _warn_before_ampere(str(gpu_compute_capability()))
    return False
  if pallas_triton_available():
    unknown = pallas_triton_gpu.unknown_device_gpu()
    if unknown is None:
      return True
    _warn_unknown_gpu(unknown)
    return False
  if jax.default_backend() == "gpu":
    _warn_no_triton()
  return False


@functools.cache
def _warn_before_ampere(cc: str) -> None:
  warnings.warn(f"this GPU (compute capability {cc}) predates sm_80's bf16 tensor cores, for which sparsejax's "
                "Triton kernels are written, so their XLA paths run instead (impl='triton' forces the kernels).",
                RuntimeWarning, stacklevel=4)


@functools.cache
def _warn_unknown_gpu(kind: str) -> None:
  warnings.warn(f"jax {jax.__version__}'s Pallas Triton does not know the GPU {kind!r} and sparsejax could not enter "
                "it, so the XLA paths run instead of the Triton kernels.", RuntimeWarning, stacklevel=4)


@functools.cache
def _warn_no_triton() -> None:
  warnings.warn(f"jax {jax.__version__} has no Pallas Triton backend: sparsejax's Triton kernels are unavailable, "
                "so their XLA paths run instead (slower).", RuntimeWarning, stacklevel=4)


def require_triton(op: str, instead: str = "impl='auto' or impl='xla'") -> None:
  """Raises (one line, at trace time) where an explicit Triton impl asks for the backend this jax lacks."""
  if not pallas_triton_available():
    raise RuntimeError(f"{op} runs Pallas Triton kernels, but jax {jax.__version__} has no Pallas Triton backend; "
                       f"use {instead}.")
