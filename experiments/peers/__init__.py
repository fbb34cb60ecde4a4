"""The peers of experiments/bench_moe_layer.py, one small file each.

common.py            the problem, its float32 reference, the check, the one timer
xla.py               balanced_bmm, capacity_einsum_cf*, ragged_dot (plain bf16 XLA)
sparsejax_variants.py  sparsejax_pallas / _mosaic / _triton (sparsejax.expert_ffn, padded layout)
torch_grouped_mm.py  torch._grouped_mm, in the same process
ragged_dot_mgpu.py   JAX's Mosaic GPU ragged_dot example (forward), its configs tuned
layer.py             the whole layer through sparsejax.moe_mlp, its reference and profile
"""
