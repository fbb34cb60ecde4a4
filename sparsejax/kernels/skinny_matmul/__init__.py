"""Products of a few rows (decoding) with one weight matrix, or with the chosen experts' weights.

op.py: the contract, its custom_vjp and the dispatch; reference.py: the pure-jnp version the kernel
is tested against; triton.py: the Pallas Triton kernel (split-K, reads each weight byte once);
triton_row_ffn.py: a one-row feed-forward as one kernel of hidden-layer slabs, and the kernel that sums its
parts, combines the slots and adds the residual (skinny_ffn_residual; routed_ffn_residual where the kernels
select the token's experts themselves from its router's partial logits).
skinny_ffn runs a feed-forward's two products as that one kernel at one row, else with the hidden
layer inside the second's kernel, or in the first's epilogue where its programs take all of K;
split_k_parts leaves a product unsummed for a kernel that sums it as it loads it.
"""
from sparsejax.kernels.skinny_matmul.op import (IMPLS, MAX_ROWS, activates_in_first, folds_norm, fuses_hidden,
                                                fuses_residual, fuses_routing, routed_ffn_residual, runs_kernel,
                                                runs_row_ffn, skinny_ffn, skinny_ffn_residual, skinny_matmul,
                                                split_k_parts)
from sparsejax.kernels.skinny_matmul.reference import skinny_matmul_reference

__all__ = ["IMPLS", "MAX_ROWS", "activates_in_first", "folds_norm", "fuses_hidden", "fuses_residual", "fuses_routing",
           "routed_ffn_residual", "runs_kernel", "runs_row_ffn", "skinny_ffn", "skinny_ffn_residual", "skinny_matmul",
           "skinny_matmul_reference", "split_k_parts"]
