"""A decode step's placement of each expert's tokens in groups of rows, as one Pallas kernel.

op.py: the contract and the dispatch; reference.py: the placement in XLA ops; triton.py: the Pallas Triton kernel.
"""
from sparsejax.kernels.group_rows.op import IMPLS, group_rows, runs_kernel
from sparsejax.kernels.group_rows.reference import group_rows_reference, row_groups

__all__ = ["IMPLS", "group_rows", "group_rows_reference", "row_groups", "runs_kernel"]
