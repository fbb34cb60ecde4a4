"""The library's own expert MLP: sparsejax.expert_ffn on the 128-row block-padded layout.

sparsejax_pallas: impl="pallas", the kernels moe_mlp's "auto" runs on this GPU (Mosaic GPU on
  sm_90, Pallas-Triton elsewhere; the record names which). sparsejax_mosaic / sparsejax_triton:
  one backend each. A named backend that is the one "pallas" resolves to runs the same program,
  so it is not compiled and timed twice: its record is a copy marked same_as.
The rows are placed the way moe_mlp places them (permute.dropless_placement with block_size=128),
outside the timed call; useful FLOPs count the N real rows, not the padding.
"""
from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np

import sparsejax as sj
from sparsejax import permute
from sparsejax.kernels.gmm import resolve_backend
from sparsejax.topology import BLOCK_SIZE, make_topology

from peers.common import Case, Problem, Reference, compare, jax_case

IMPL_BACKEND = {"pallas": "auto", "mosaic": "mosaic", "triton": "triton"}


def topology(placement: permute.Placement):
  """make_topology for a dropless placement, passing the real row counts where it takes them."""
  if "group_sizes" in inspect.signature(make_topology).parameters:
    return make_topology(placement.group_sizes, placement.num_rows, BLOCK_SIZE,
                         group_sizes=placement.tokens_per_expert)
  return make_topology(placement.group_sizes, placement.num_rows, BLOCK_SIZE)


def padded_positions(p: Problem) -> tuple[permute.Placement, np.ndarray]:
  """The block-padded placement and, for each sorted row, its row in the padded buffer (both
  placements put assignment (t, j) at its expert's offset plus the same rank)."""
  s = p.shape
  padded = permute.dropless_placement(p.ids, s.E, block_size=BLOCK_SIZE)
  sorted_ = permute.dropless_placement(p.ids, s.E)
  order = np.argsort(np.asarray(sorted_.rows).reshape(-1))
  return padded, np.asarray(padded.rows).reshape(-1)[order]


def sparsejax_case(p: Problem, ref: Reference, impl: str) -> Case:
  """impl in ("pallas", "mosaic", "triton")."""
  s = p.shape
  placement, pos = padded_positions(p)
  topo = topology(placement)
  rows = jnp.zeros((placement.num_rows, s.d), p.rows.dtype).at[pos].set(p.rows)
  ct = jnp.zeros_like(rows).at[pos].set(p.ct)

  def ffn(rows, topo, w_in, w_out):
    return sj.expert_ffn(rows, None, w_in, w_out, impl=impl, topology=topo)

  def check(y, grads):
    dx, dw_in, dw_out = grads
    return compare(y[pos], (dx[pos], dw_in, dw_out), ref)

  return jax_case(f"sparsejax_{impl}", ffn, (rows, topo, p.w_in, p.w_out), ct, s.N, check,
                  backend=resolve_backend(IMPL_BACKEND[impl]), padded_rows=placement.num_rows)
