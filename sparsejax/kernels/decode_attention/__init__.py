"""Attention of one new query per row over a KV cache (a decode step).

op.py: the contract, its custom_vjp and the dispatch; reference.py: the masked softmax in jnp that
the kernels are tested against; triton.py: the split-cache Pallas Triton kernels (flash-decoding), the
second of which also makes the step's q, k, v from the projection's parts and writes the caches.
"""
from sparsejax.kernels.decode_attention.op import IMPLS, decode_attention, decode_attention_step
from sparsejax.kernels.decode_attention.reference import (decode_attention_reference,
                                                          decode_attention_step_reference)

__all__ = ["IMPLS", "decode_attention", "decode_attention_reference", "decode_attention_step",
           "decode_attention_step_reference"]
