"""Products of a few rows (decoding) with one weight matrix, or with the chosen experts' weights.

op.py: the contract, its custom_vjp and the dispatch; reference.py: the pure-jnp version the kernel
is tested against; triton.py: the Pallas Triton kernel (split-K, reads each weight byte once).
"""
from sparsejax.kernels.skinny_matmul.op import IMPLS, MAX_ROWS, folds_norm, runs_kernel, skinny_matmul
from sparsejax.kernels.skinny_matmul.reference import skinny_matmul_reference

__all__ = ["IMPLS", "MAX_ROWS", "folds_norm", "runs_kernel", "skinny_matmul", "skinny_matmul_reference"]
