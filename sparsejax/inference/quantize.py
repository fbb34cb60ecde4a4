"""int8 weight-only experts: per-output-channel absmax scales, dequantized on the fly by the MoE layer.

q[e, o, i] = round(W[e, i, o] / s[e, o]) in [-127, 127] with s[e, o] = max_i |W[e, i, o]| / 127, so
|W - q^T s| <= s / 2 elementwise. q is stored k-major, [experts, n_out, n_in]: each output channel's inputs
contiguous, the layout whose int8 products Triton reads fastest (skinny_matmul.reference.k_major). Expert
weights are most of an MoE model's bytes; int8 halves what a bf16 decode step reads from them. Only the
experts are quantized (router, attention, embeddings stay).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int8

from sparsejax.inference.decode_moe import dequantize

EXPERT_WEIGHTS = ("w_in", "w_gate", "w_out")


def quantize_weight(w: Float[Array, "experts n_in n_out"]
                    ) -> tuple[Int8[Array, "experts n_out n_in"], Float[Array, "experts n_out"]]:
  """(q, s): s[e, o] = max_i |w[e, i, o]| / 127 (1 where a column is all zeros), q[e, o, i] = round(w[e, i, o] /
  s[e, o]): k-major, the transpose of w's last two axes."""
  if jnp.ndim(w) != 3:
    raise ValueError(f"expert weights must be [experts, n_in, n_out]; got shape {jnp.shape(w)}.")
  if not jnp.issubdtype(jnp.result_type(w), jnp.floating):
    raise TypeError(f"only floating expert weights can be quantized; got dtype {jnp.result_type(w)}.")
  w32 = jnp.asarray(w, jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=1)
  s = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(w32 / s[:, None, :]), -127, 127).astype(jnp.int8)
  return jnp.swapaxes(q, 1, 2), s


def _is_moe_params(d: Any) -> bool:
  return isinstance(d, dict) and "router" in d and jnp.ndim(d.get("w_in")) == 3


def quantize_experts(params: dict) -> dict:
  """A copy of a pure params dict (nnx.to_pure_dict(nnx.state(model))) in which every MoE layer's
  w_in / w_gate / w_out is int8 with a float32 `<name>_scale` beside it; everything else is shared."""
  if not isinstance(params, dict):
    raise TypeError(f"quantize_experts takes a pure params dict (nnx.to_pure_dict(nnx.state(model))); "
                    f"got {type(params).__name__}. For a model, use quantize_model.")

  found = []

  def walk(d):
    if not isinstance(d, dict):
      return d
    if _is_moe_params(d):
      if "w_in_scale" in d:
        raise ValueError("these params are already quantized (w_in_scale is present).")
      found.append(d)
      out = dict(d)
      for name in EXPERT_WEIGHTS:
        if d.get(name) is not None:
          out[name], out[f"{name}_scale"] = quantize_weight(d[name])
      return out
    return {k: walk(v) for k, v in d.items()}

  out = walk(params)
  # A dense model's params, or the wrong subtree, would otherwise come back unquantized without a word.
  if not found:
    raise ValueError("the params hold no MoE layer (a dict with a router and an [E, d, f] w_in): there are no "
                     "expert weights to quantize.")
  return out


def _moe_modules(model: nnx.Module):
  from sparsejax.modules import MoE
  if not isinstance(model, nnx.Module):  # a params dict would pass through dequantize_model unchanged
    raise TypeError(f"expected an nnx model (e.g. a Transformer); got {type(model).__name__}. For a pure params "
                    "dict use quantize_experts (its int8 experts dequantize inside the layer).")
  it = nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules()
  return [m for _, m in it if isinstance(m, MoE)]


def quantize_model(model: nnx.Module) -> nnx.Module:
  """A copy of model whose MoE layers hold int8 experts and float32 scales; the MoE layer then
  dequantizes inside its call (so inside whatever jit runs it). The input model is unchanged."""
  model = nnx.clone(model)
  moes = _moe_modules(model)
  if not moes:
    raise ValueError("the model has no MoE layer: there are no expert weights to quantize.")
  for moe in moes:
    if getattr(moe, "w_in_scale", None) is not None:
      raise ValueError("the model's experts are already quantized.")
    for name in EXPERT_WEIGHTS:
      p = getattr(moe, name)
      if p is not None:
        q, s = quantize_weight(p[...])
        setattr(moe, name, nnx.Param(q))
        setattr(moe, f"{name}_scale", nnx.Param(s))
  return model


def dequantize_model(model: nnx.Module) -> nnx.Module:
  """The float model (param_dtype) holding q * s: the reference the int8 layer is compared with."""
  model = nnx.clone(model)
  for moe in _moe_modules(model):
    for name in EXPERT_WEIGHTS:
      s = getattr(moe, f"{name}_scale", None)
      if s is not None:
        setattr(moe, name, nnx.Param(dequantize(getattr(moe, name)[...], s[...], moe.config.param_dtype)))
        delattr(moe, f"{name}_scale")
  return model


def expert_bytes(model: nnx.Module) -> int:
  """Bytes of all expert weights (and scales) of the model's MoE layers."""
  total = 0
  for moe in _moe_modules(model):
    for name in EXPERT_WEIGHTS:
      for attr in (name, f"{name}_scale"):
        p = getattr(moe, attr, None)
        if p is not None:
          total += p[...].size * p[...].dtype.itemsize
  return total
