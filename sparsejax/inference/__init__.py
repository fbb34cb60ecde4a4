"""Inference: KV-cache generation, the small-batch MoE layer, int8 experts, and the generate CLI.

Submodules import no model code at import time (the Transformer imports kv_cache from here).
"""
from sparsejax.inference.decode_moe import SMALL_BATCH_MAX_ASSIGNMENTS, decode_moe_mlp, dequantize
from sparsejax.inference.generate import Decoder, Generation, generate, generate_timed, left_pad
from sparsejax.inference.quantize import (
    dequantize_model, expert_bytes, quantize_experts, quantize_model, quantize_weight)
from sparsejax.inference.sampling import Sampling, sample_logits

__all__ = [
    "Decoder", "Generation", "SMALL_BATCH_MAX_ASSIGNMENTS", "Sampling", "decode_moe_mlp", "dequantize",
    "dequantize_model", "expert_bytes", "generate", "generate_timed", "left_pad", "quantize_experts",
    "quantize_model", "quantize_weight", "sample_logits",
]
