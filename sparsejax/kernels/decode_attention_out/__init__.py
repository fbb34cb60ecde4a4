"""A decode step's attention and its output projection, y = concat_h o_h @ W_o, as one kernel at one row.

op.py: the contract, its custom_vjp and the dispatch (else decode_attention, then skinny_matmul);
triton.py: one Pallas Triton kernel, a program per head and column block: the head's attention, then its W_o slab.
"""
from sparsejax.kernels.decode_attention_out.op import IMPLS, decode_attention_out, kernel_fits, runs_kernel

__all__ = ["IMPLS", "decode_attention_out", "kernel_fits", "runs_kernel"]
