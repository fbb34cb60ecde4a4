"""A decode step's attention and its output projection, y = concat_h o_h @ W_o, as one kernel at one row.

op.py: the contract, its custom_vjp and the dispatch (else decode_attention, then skinny_matmul);
triton.py: one Pallas Triton grid whose W_o programs load their weights while the attention's run.
"""
from sparsejax.kernels.decode_attention_out.op import IMPLS, decode_attention_out, kernel_fits, runs_kernel

__all__ = ["IMPLS", "decode_attention_out", "kernel_fits", "runs_kernel"]
