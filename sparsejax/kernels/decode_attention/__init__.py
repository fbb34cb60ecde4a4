"""Attention of one new query per row over a KV cache (a decode step).

op.py: the contract, its custom_vjp and the dispatch; reference.py: the masked softmax in jnp that
the kernel is tested against; triton.py: the split-cache Pallas Triton kernel (flash-decoding).
"""
from sparsejax.kernels.decode_attention.op import IMPLS, decode_attention
from sparsejax.kernels.decode_attention.reference import decode_attention_reference

__all__ = ["IMPLS", "decode_attention", "decode_attention_reference"]
