"""sparsejax: dropless Mixture-of-Experts for JAX."""
from sparsejax.config import MoEConfig
from sparsejax.grouped_matmul import grouped_matmul, grouped_matmul_reference
from sparsejax.losses import load_balancing_loss, router_z_loss
from sparsejax.modules import MLP, MoE, MoELayerStats, Router
from sparsejax.moe import MoEStats, capacity, expert_choice_mlp, expert_ffn, moe_mlp
from sparsejax.permute import Placement, capacity_placement, dropless_placement
from sparsejax.reference import moe_mlp_reference
from sparsejax.routing import (
    NO_EXPERT,
    ExpertChoiceRouting,
    TokenChoiceRouting,
    dense_to_sparse_routing,
    dts_temperature_schedule,
    expert_choice_routing,
    router_logits,
    top_k_routing,
)

__version__ = "0.1.0"

__all__ = [
    "MLP", "MoE", "MoEConfig", "MoELayerStats", "MoEStats", "NO_EXPERT", "Placement", "Router",
    "ExpertChoiceRouting", "TokenChoiceRouting", "capacity", "capacity_placement",
    "dense_to_sparse_routing", "dropless_placement", "dts_temperature_schedule", "expert_choice_mlp",
    "expert_choice_routing", "expert_ffn", "grouped_matmul", "grouped_matmul_reference",
    "load_balancing_loss", "moe_mlp", "moe_mlp_reference", "router_logits", "router_z_loss",
    "top_k_routing",
]

# --- Language models built on the layers above (sparsejax.models). Training, checkpoints and
# upcycling live in sparsejax.train / .checkpoint / .upcycle, imported on use (orbax, tqdm).
from sparsejax.models import PRESETS, ModelStats, Transformer, TransformerConfig, get_preset  # noqa: E402

__all__ += ["PRESETS", "ModelStats", "Transformer", "TransformerConfig", "get_preset"]

# --- Expert parallelism (sparsejax.parallel, sparsejax.mesh) ---
from sparsejax.mesh import ExpertLayout, expert_layout, make_expert_mesh, param_shardings
from sparsejax.parallel import ExpertParallelConfig, ExpertParallelStats, expert_parallel_moe_mlp

__all__ += [
    "ExpertLayout", "ExpertParallelConfig", "ExpertParallelStats", "expert_layout",
    "expert_parallel_moe_mlp", "make_expert_mesh", "param_shardings",
]

# --- Inference: KV-cache generation, small-batch MoE decoding, int8 experts (sparsejax.inference) ---
from sparsejax.inference import (  # noqa: E402
    Decoder, Generation, Sampling, decode_moe_mlp, dequantize_model, generate, generate_timed,
    quantize_experts, quantize_model, quantize_weight)

__all__ += [
    "Decoder", "Generation", "Sampling", "decode_moe_mlp", "dequantize_model", "generate", "generate_timed",
    "quantize_experts", "quantize_model", "quantize_weight",
]
