"""The qkv projection's split-K parts into a decode step's query and cache slot.

op.py: the contract, its custom_vjp and the dispatch; reference.py: the sum, RoPE and cache writes in
jnp that the kernel is tested against; triton.py: Pallas Triton programs per (row, head) and q, k or v.
"""
from sparsejax.kernels.decode_qkv.op import IMPLS, decode_qkv, runs_kernel
from sparsejax.kernels.decode_qkv.reference import decode_qkv_reference

__all__ = ["IMPLS", "decode_qkv", "decode_qkv_reference", "runs_kernel"]
