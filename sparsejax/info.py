"""What sparsejax's "auto" choices are on this machine: `python -m sparsejax.info`.

The grouped products, attention, router precision and decode kernels pick their backend from the device (Mosaic GPU
on Hopper, Triton on other GPUs from sm_80, XLA before sm_80, off the GPU, or where jax lacks Pallas' Triton
backend). This prints each choice, as the library makes it, so a user on an untested card can see what will run.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

import sparsejax
from sparsejax import _precision, kernels
from sparsejax.grouped_matmul import resolve_impl
from sparsejax.kernels import pallas_triton_gpu
from sparsejax.kernels.gmm import op as gmm_op, triton as gmm_triton
from sparsejax.models import TransformerConfig
from sparsejax.models.transformer import attention_impl


def choices() -> dict[str, str]:
  """Each "auto" choice on the default device, with the warnings it raised (one line each)."""
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    device = jax.devices()[0]
    out = {
        "sparsejax": sparsejax.__version__,
        "jax": jax.__version__,
        "device": f"{jax.default_backend()}: {device.device_kind}",
        "compute capability": str(kernels.gpu_compute_capability() or "-"),
        "Pallas Triton backend": "yes" if kernels.pallas_triton_available() else "no",
    }
    for name, dtype in (("bfloat16", jnp.bfloat16), ("float32", jnp.float32)):
      impl = resolve_impl("auto", dtype)
      if impl == "pallas":  # the kernels that run: Mosaic hands float32 to Triton (wgmma would read it as TF32)
        backend = gmm_op.resolve_backend("auto", dtype)
        impl = f"pallas ({'triton' if gmm_op.runs_triton(backend, dtype) else backend})"
      out[f"MoE experts, {name}"] = impl
    model = TransformerConfig(d_model=64, num_layers=1, num_heads=1, d_ff=64, dtype="bfloat16")
    out["attention, bfloat16"] = attention_impl(model) or "xla"
    out["router's float32 dots"] = str(_precision.float32_by_bf16_passes())
    out["decode kernels"] = "triton" if jax.default_backend() == "gpu" and kernels.auto_takes_triton() else "xla"
    if jax.default_backend() == "gpu":
      out["Pallas Triton finds the GPU"] = pallas_triton_gpu.lookup()
      out["shared memory a block"] = f"{kernels.shared_memory_limit() // 1024} KiB"
      t = gmm_triton._for_dtype(gmm_triton.DEFAULT_TILING, jnp.bfloat16)
      out["Triton gmm / tgmm tiles, bfloat16"] = (
          f"gmm 128 x {t.block_n} x {t.block_k}, {t.num_stages} stages; "
          f"tgmm {t.tgmm_block_k} x {t.tgmm_block_n}, {t.tgmm_num_stages} stages")
  for i, w in enumerate(dict.fromkeys(str(w.message) for w in seen)):
    out[f"warning {i + 1}"] = w
  return out


def main() -> None:
  rows = choices()
  width = max(map(len, rows))
  for key, value in rows.items():
    print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
  main()
