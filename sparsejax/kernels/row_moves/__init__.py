"""The MoE layer's forward row gather (x -> expert buffer) as a Pallas kernel.

op.py: the contract, its custom_vjp and the dispatch; reference.py: XLA's filling gather;
triton.py: the Pallas Triton kernel.
"""
from sparsejax.kernels.row_moves.op import IMPLS, gather_rows, runs_kernel
from sparsejax.kernels.row_moves.reference import gather_rows_reference

__all__ = ["IMPLS", "gather_rows", "gather_rows_reference", "runs_kernel"]
