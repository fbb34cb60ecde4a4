"""torch._grouped_mm (PyTorch's CUTLASS grouped GEMM, the one torchtitan's MoE calls), in this process.

It gets the benchmark's own bf16 arrays through DLPack (same rows, weights and cotangent as every
JAX peer) and the same timer, with torch.cuda.synchronize() as the sync. The weights are stored as
torchtitan stores them, [E, out, in], and passed transposed ([E, in, out], column-major), and the
activation is gelu(approximate="tanh"), which is jax.nn.gelu's default. The forward runs under
torch.no_grad(); the forward+backward is out.backward(ct) with the grads set to None before each
call, as a training step does.

JAX and torch share the GPU: the driver sets XLA_PYTHON_CLIENT_PREALLOCATE=false (and caps JAX's
share with XLA_PYTHON_CLIENT_MEM_FRACTION) before JAX starts, and this peer empties torch's
cache when it is done.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from peers.common import Case, Problem, Reference, compare


def unavailable() -> str | None:
  """Why this peer cannot run here, or None."""
  if jax.default_backend() != "gpu":
    return "torch._grouped_mm is GPU-only; JAX runs on " + jax.default_backend()
  try:
    import torch
  except ImportError as e:
    return f"torch not importable: {e}"
  if not torch.cuda.is_available():
    return "torch sees no CUDA device"
  if not hasattr(torch, "_grouped_mm"):
    return f"torch {torch.__version__} has no _grouped_mm"
  return None


def to_torch(a):
  """A JAX array as a torch CUDA tensor of its own (DLPack, else through the host)."""
  import torch

  jax.block_until_ready(a)
  try:
    return torch.from_dlpack(a).clone()
  except Exception:  # noqa: BLE001 - DLPack support varies across versions; the host copy is exact
    t = torch.from_numpy(np.asarray(a.astype(jnp.float32)))
    return t.to("cuda", getattr(torch, str(a.dtype)))


def to_jax(t):
  try:
    return jnp.from_dlpack(t.detach().contiguous())
  except Exception:  # noqa: BLE001
    return jnp.asarray(t.detach().float().cpu().numpy())


def torch_grouped_mm(p: Problem, ref: Reference) -> Case:
  import torch
  import torch.nn.functional as F

  s = p.shape
  x = to_torch(p.rows)
  ct = to_torch(p.ct)
  # [E, out, in] storage, used transposed: [E, in, out] with column-major strides.
  w_in = to_torch(jnp.swapaxes(p.w_in, 1, 2)).transpose(-2, -1)
  w_out = to_torch(jnp.swapaxes(p.w_out, 1, 2)).transpose(-2, -1)
  # A copy: p.counts may be a read-only view of a jax array, which torch.as_tensor warns about.
  offs = torch.cumsum(torch.as_tensor(np.array(p.counts), device="cuda"), 0).to(torch.int32)

  def mlp(x, w_in, w_out):
    h = torch._grouped_mm(x, w_in, offs=offs)
    return torch._grouped_mm(F.gelu(h, approximate="tanh"), w_out, offs=offs)

  xg = x.clone().requires_grad_()
  wi = w_in.detach().clone().requires_grad_()  # clone keeps the column-major strides
  wo = w_out.detach().clone().requires_grad_()

  def fwd():
    with torch.no_grad():
      return mlp(x, w_in, w_out)

  def fwdbwd():
    xg.grad = wi.grad = wo.grad = None
    mlp(xg, wi, wo).backward(ct)
    return None

  def check():
    y = fwd()
    fwdbwd()
    torch.cuda.synchronize()
    return compare(to_jax(y), (to_jax(xg.grad), to_jax(wi.grad), to_jax(wo.grad)), ref)

  return Case("torch_grouped_mm", fwd, fwdbwd, lambda _: torch.cuda.synchronize(), check, s.N,
              {"torch": torch.__version__, "weight_layout": "[E, out, in] transposed (torchtitan)"})


def release():
  """Give torch's cached GPU memory back, for the JAX peers that run after this one."""
  import torch

  torch.cuda.synchronize()
  torch.cuda.empty_cache()
