"""A decode step's glue between layers: residual add of the previous layer's split-K partials, RMSNorm,
and optionally the next MoE layer's top-k routing, as one op.

op.py: the contract, its custom_vjp and the dispatch; reference.py: the pure-jnp version the kernel is
tested against (and its pieces, which the unfused layers share); triton.py: the Pallas Triton kernel.
"""
from sparsejax.kernels.residual_norm.op import IMPLS, residual_norm
from sparsejax.kernels.residual_norm.reference import pending_delta, residual_norm_reference, rms_norm

__all__ = ["IMPLS", "pending_delta", "residual_norm", "residual_norm_reference", "rms_norm"]
