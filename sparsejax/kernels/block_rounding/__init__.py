"""Token rounding's moves (which assignments an expert drops, which next choices it takes), by Pallas kernels.

op.py: the contract and the dispatch; reference.py: the moves by sorts in XLA ops; triton.py: the Pallas Triton
kernels, a selection by bisection per expert (and under an axis, one more for the group's threshold).
"""
from sparsejax.kernels.block_rounding.op import IMPLS, block_moves, runs_kernel
from sparsejax.kernels.block_rounding.reference import (block_moves_reference, group_moves_reference, move_counts,
                                                        ranks_within)

__all__ = ["IMPLS", "block_moves", "block_moves_reference", "group_moves_reference", "move_counts", "ranks_within",
           "runs_kernel"]
