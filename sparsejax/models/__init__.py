"""Language models built from the sparsejax feed-forward layers."""
from sparsejax.models.config import PRESETS, TransformerConfig, get_preset
from sparsejax.models.transformer import ModelStats, Transformer, cross_entropy

__all__ = ["PRESETS", "ModelStats", "Transformer", "TransformerConfig", "cross_entropy", "get_preset"]
