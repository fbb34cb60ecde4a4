"""A decode step's qkv glue (the split-K parts' sum, RoPE, the cache write) and its attention as one kernel.

op.py: the contract, its custom_vjp and the dispatch (else decode_qkv, then decode_attention); triton.py:
decode_attention's chunk programs, each summing and turning its head's query from the parts itself.
"""
from sparsejax.kernels.decode_qkv_attention.op import IMPLS, decode_qkv_attention, kernel_fits, runs_kernel

__all__ = ["IMPLS", "decode_qkv_attention", "kernel_fits", "runs_kernel"]
