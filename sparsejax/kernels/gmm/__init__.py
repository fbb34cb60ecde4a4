"""The grouped products of the dropless MoE (MegaBlocks' SDD / DSD / DS^T D) as Pallas GPU kernels.

op.py: the contract and its custom_vjp; reference.py: the pure-jnp version every backend is tested
against; triton.py and mosaic.py: the backends. mlp.py: the expert MLP act(x W_in) W_out, whose
activation the Mosaic backend fuses into the kernels' epilogues.
"""
from sparsejax.kernels.gmm.op import BACKENDS, gmm, grouped_matmul_padded, resolve_backend, tgmm
from sparsejax.kernels.gmm.mlp import expert_mlp
from sparsejax.kernels.gmm.reference import gmm_reference, mlp_reference, tgmm_reference

__all__ = ["BACKENDS", "expert_mlp", "gmm", "gmm_reference", "grouped_matmul_padded", "mlp_reference",
           "resolve_backend", "tgmm", "tgmm_reference"]
