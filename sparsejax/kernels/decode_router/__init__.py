"""Top-k routing of a few tokens (decoding) in Pallas kernels: logits, softmax and the k largest.

op.py: the contract, its custom_vjp and the dispatch; reference.py: the library's routing functions,
which the kernels are tested against; triton.py: the Pallas Triton kernels (split-K partial logits,
then one program per token that selects).
"""
from sparsejax.kernels.decode_router.op import IMPLS, decode_router, kernel_fits, runs_kernel
from sparsejax.kernels.decode_router.reference import decode_router_reference

__all__ = ["IMPLS", "decode_router", "decode_router_reference", "kernel_fits", "runs_kernel"]
