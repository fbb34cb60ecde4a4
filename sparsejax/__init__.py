"""sparsejax: dropless Mixture-of-Experts for JAX.

The flat public API below is imported on first use (PEP 562), so that `import sparsejax.cli` (the
`sparsejax-train` command) parses its arguments and answers `--help` without importing jax.
`sj.moe_mlp`, `from sparsejax import moe_mlp` and `dir(sparsejax)` work as with eager imports.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "sparsejax.config": ["MoEConfig"],
    "sparsejax.grouped_matmul": ["grouped_matmul", "grouped_matmul_reference"],
    "sparsejax.losses": ["load_balancing_loss", "router_z_loss"],
    "sparsejax.modules": ["MLP", "MoE", "MoELayerStats", "Router"],
    "sparsejax.moe": ["MoEStats", "capacity", "expert_choice_mlp", "expert_ffn", "moe_mlp"],
    "sparsejax.permute": ["Placement", "capacity_placement", "dropless_placement"],
    "sparsejax.reference": ["moe_mlp_reference"],
    "sparsejax.routing": [
        "NO_EXPERT", "ExpertChoiceRouting", "TokenChoiceRouting", "dense_to_sparse_routing",
        "dts_temperature_schedule", "expert_choice_routing", "router_logits", "top_k_routing",
    ],
    "sparsejax.token_rounding": ["round_to_blocks", "rounded_moe_mlp"],
    "sparsejax.top_k": ["top_k_small"],
    # Language models built on the layers above. Training, checkpoints and upcycling live in
    # sparsejax.train / .checkpoint / .upcycle, imported on use (orbax, tqdm).
    "sparsejax.models": ["PRESETS", "ModelStats", "Transformer", "TransformerConfig", "get_preset"],
    # Expert parallelism.
    "sparsejax.mesh": ["ExpertLayout", "expert_layout", "make_expert_mesh", "param_shardings"],
    "sparsejax.parallel": ["ExpertParallelConfig", "ExpertParallelStats", "expert_parallel_moe_mlp"],
    # Inference: KV-cache generation, small-batch MoE decoding, int8 experts.
    "sparsejax.inference": [
        "Decoder", "Generation", "Sampling", "decode_moe_mlp", "dequantize_model", "generate",
        "generate_timed", "quantize_experts", "quantize_model", "quantize_weight",
    ],
    # The decode step's kernels (Pallas Triton on a GPU, their jnp references elsewhere).
    "sparsejax.kernels.skinny_matmul": ["skinny_matmul"],
    "sparsejax.kernels.decode_attention": ["decode_attention"],
    "sparsejax.kernels.decode_router": ["decode_router"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


class _Package(types.ModuleType):
  def __setattr__(self, name, value):
    # Importing a submodule binds it as an attribute of its package; where a public function shares
    # its module's name (grouped_matmul), the name stays the function's, as with eager imports.
    if name in _WHERE and isinstance(value, types.ModuleType):
      return
    super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
  if name in _WHERE:
    value = getattr(importlib.import_module(_WHERE[name]), name)
  elif importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule, e.g. sj.routing
    value = importlib.import_module(f"{__name__}.{name}")
  else:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  globals()[name] = value  # later lookups skip __getattr__
  return value


def __dir__():
  # The public names, the submodules already imported and the dunders; not this file's own imports.
  own = {"annotations", "importlib", "sys", "types", "TYPE_CHECKING"}
  return sorted((set(globals()) - own) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
  from sparsejax.config import MoEConfig
  from sparsejax.grouped_matmul import grouped_matmul, grouped_matmul_reference
  from sparsejax.kernels.decode_attention import decode_attention
  from sparsejax.kernels.decode_router import decode_router
  from sparsejax.kernels.skinny_matmul import skinny_matmul
  from sparsejax.inference import (
      Decoder, Generation, Sampling, decode_moe_mlp, dequantize_model, generate, generate_timed,
      quantize_experts, quantize_model, quantize_weight)
  from sparsejax.losses import load_balancing_loss, router_z_loss
  from sparsejax.mesh import ExpertLayout, expert_layout, make_expert_mesh, param_shardings
  from sparsejax.models import PRESETS, ModelStats, Transformer, TransformerConfig, get_preset
  from sparsejax.modules import MLP, MoE, MoELayerStats, Router
  from sparsejax.moe import MoEStats, capacity, expert_choice_mlp, expert_ffn, moe_mlp
  from sparsejax.parallel import ExpertParallelConfig, ExpertParallelStats, expert_parallel_moe_mlp
  from sparsejax.permute import Placement, capacity_placement, dropless_placement
  from sparsejax.reference import moe_mlp_reference
  from sparsejax.routing import (
      NO_EXPERT, ExpertChoiceRouting, TokenChoiceRouting, dense_to_sparse_routing,
      dts_temperature_schedule, expert_choice_routing, router_logits, top_k_routing)
  from sparsejax.top_k import top_k_small
