"""Which GPU Pallas Triton lowers for, where jax looks the GPU up by name.

jax 0.10 read a Pallas Triton kernel's compute capability from the device, and took sm_90 without one. jax 0.11
reads it from a table of device kinds (`jax._src.pallas.triton.gpu_info`: A100, A10, H100, H200, L4, L40, RTX 4090,
T4, Blackwell parts) and the table's registry of further kinds. Outside the two:
- without a GPU, lowering for CUDA stops ("No supported GPU devices found") unless an abstract device names a kind
  the table or registry has;
- a real card gets its own capability on jax 0.11.2 where its name starts with "NVIDIA" (an RTX 3090, an A10G, an
  L40S). A jax 0.11 without that fallback stops, as 0.11.2 does on other names (a "Tesla V100").

So:
- `register_device_gpu()` enters the process's GPU in the registry under its own kind and capability where the
  table lacks the kind. shared_lowering calls it before a kernel lowers, so every Triton kernel of the library
  lowers on such a card as on jax 0.10;
- `lower_for_gpu(fn, *args)` lowers fn for CUDA from a host without a GPU, as on the GPU it names (the tests'
  and the experiments' lowering checks; an ahead-of-time export), through an abstract device.

The library's own per-GPU choices (Triton tiles, sm_90-only hints) still follow the process's device: off the
GPU they are Hopper's, whichever GPU the lowering names.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

# What lower_for_gpu names by default: the GPU the Hopper defaults are written for.
DEFAULT_GPU = "NVIDIA H100 80GB HBM3"


def _gpu_table():
  """jax's device-kind table, or None where this jax reads the capability from the device (jax < 0.11)."""
  try:
    from jax._src.pallas.triton import gpu_info
  except ImportError:
    return None
  needed = ("registry", "gpu_version_from_device_kind", "GpuInfo")
  return gpu_info if all(hasattr(gpu_info, name) for name in needed) else None


def knows_gpu(device_kind: str) -> bool:
  """Whether jax's table or its registry has this kind (True on a jax that reads the device itself): then Pallas
  Triton lowers for a GPU of this kind, real or abstract."""
  table = _gpu_table()
  return table is None or table.gpu_version_from_device_kind(device_kind) is not None or device_kind in table.registry


def _capability(compute_capability: str) -> tuple[int, int]:
  try:
    major, minor = (int(part) for part in str(compute_capability).split("."))
  except ValueError:
    raise ValueError(f"compute_capability must read 'major.minor' (e.g. '8.9'), got {compute_capability!r}") from None
  return major, minor


def register_gpu(device_kind: str, compute_capability: str) -> None:
  """Enters device_kind with compute capability "major.minor" in jax's table where the table lacks the kind (a
  kind it has keeps jax's entry; a jax without the table needs nothing)."""
  major, minor = _capability(compute_capability)
  table = _gpu_table()
  if knows_gpu(device_kind) or table is None:
    return
  try:
    info = table.GpuInfo(gpu_version=None, arch_name=f"{major}.{minor}", compute_capability=10 * major + minor)
  except TypeError:  # a jax whose GpuInfo changed: its own error stays the one the user sees
    return
  table.registry[device_kind] = lambda: info


def default_gpu() -> tuple[str, str] | None:
  """(device kind, compute capability) of the default device where it is a CUDA GPU. Read from the device itself,
  not kernels.gpu_compute_capability: a test that sets the GPU's generation there must not enter the CPU's kind in
  jax's registry."""
  if jax.default_backend() != "gpu":
    return None
  device = jax.devices()[0]
  cc = getattr(device, "compute_capability", None)
  if cc is None:
    return None
  try:
    _capability(cc)
  except ValueError:  # e.g. a ROCm arch name: jax's table holds no such part either
    return None
  return device.device_kind, str(cc)


@functools.cache
def register_device_gpu() -> None:
  """register_gpu for the default device, once a process (a process keeps its devices)."""
  gpu = default_gpu()
  if gpu is not None:
    register_gpu(*gpu)


def unknown_device_gpu() -> str | None:
  """The default GPU's kind where jax's table and registry lack it even after register_device_gpu, else None
  (always None off the GPU and on jax < 0.11)."""
  register_device_gpu()
  gpu = default_gpu()
  return None if gpu is None or knows_gpu(gpu[0]) else gpu[0]


def lookup() -> str:
  """How Pallas Triton finds the default GPU's compute capability, in words (`python -m sparsejax.info`)."""
  table = _gpu_table()
  if table is None:
    return "from the device (this jax has no device-kind table)"
  gpu = default_gpu()
  if gpu is None:
    return "-"
  if table.gpu_version_from_device_kind(gpu[0]) is not None:
    return "jax's table lists this GPU"
  return ("entered by sparsejax under its own capability (jax's table lacks it)" if unknown_device_gpu() is None
          else "jax's table lacks this GPU and sparsejax could not enter it: XLA paths run")


def lower_for_gpu(fn: Callable, *args, device_kind: str = DEFAULT_GPU,
                  compute_capability: str | None = None) -> jax.stages.Lowered:
  """jax.jit(fn) traced on args (arrays or ShapeDtypeStructs, in any pytree) and lowered for CUDA, with each Pallas
  Triton kernel lowered as for a GPU of this kind. Without a GPU an abstract device names it; on a GPU the device
  decides. compute_capability ("8.9") enters a kind jax's table lacks; without it such a kind is a ValueError."""
  if compute_capability is not None and not knows_gpu(device_kind):
    # jax 0.11.2 takes an "NVIDIA ..." kind its table lacks from the process's own GPU, before it reads the
    # registry (and refuses an abstract one); under a name of our own the registry's entry is what it reads.
    device_kind = f"sparsejax: {device_kind}"
    register_gpu(device_kind, compute_capability)
  elif not knows_gpu(device_kind):
    raise ValueError(f"jax {jax.__version__}'s Pallas Triton does not know the GPU {device_kind!r}; pass its "
                     "compute_capability (e.g. '8.9')")
  lower = lambda *a: jax.jit(fn).trace(*a).lower(lowering_platforms=("cuda",))
  if jax.default_backend() == "gpu":
    return lower(*args)
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
  # The arguments carry the mesh, as every value computed under it does: otherwise a nested jit (shared_lowering)
  # called on an argument and again on a computed value lowers its kernel twice.
  on_mesh = NamedSharding(mesh, PartitionSpec())
  args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_mesh)
                      if hasattr(a, "shape") and hasattr(a, "dtype") else a, args)
  with jax.sharding.use_abstract_mesh(mesh):
    return lower(*args)
