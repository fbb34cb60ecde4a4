"""Top-k routing of a few tokens (decoding) in Pallas kernels: logits, softmax and the k largest.

op.py: the contract, its custom_vjp and the dispatch; reference.py: the library's routing functions,
which the kernels are tested against; triton.py: the Pallas Triton kernels (split-K partial logits,
then one program per token that selects; router_logit_parts is the first kernel alone, for kernels that
select themselves).
"""
from sparsejax.kernels.decode_router.op import (IMPLS, decode_router, kernel_fits, router_logit_parts, runs_kernel,
                                                select_logit_parts, splits_logits)
from sparsejax.kernels.decode_router.reference import decode_router_reference, select_from_parts

__all__ = ["IMPLS", "decode_router", "decode_router_reference", "kernel_fits", "router_logit_parts", "runs_kernel",
           "select_from_parts", "select_logit_parts", "splits_logits"]
