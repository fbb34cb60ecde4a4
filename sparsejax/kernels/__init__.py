"""GPU kernels, one folder per op (contract + reference, one file per backend)."""
import jax


def gpu_compute_capability() -> str | None:
  """The GPU's compute capability ("9.0"), or None off the GPU (interpret mode, or a CPU lowering for CUDA)."""
  if jax.default_backend() != "gpu":
    return None
  return getattr(jax.devices()[0], "compute_capability", None)
