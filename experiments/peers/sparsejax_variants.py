"""The library's own expert MLP: sparsejax.expert_ffn on the 128-row block-padded layout.

sparsejax_pallas: impl="pallas", the kernels moe_mlp's "auto" runs on this GPU (Mosaic GPU on
  sm_90, Pallas-Triton elsewhere; the record names which). sparsejax_mosaic / sparsejax_triton:
  one backend each. A named backend that is the one "pallas" resolves to runs the same program,
  so it is not compiled and timed twice: its record is a copy marked same_as.
sparsejax_mosaic_unfused: the Mosaic kernels with the activation as its own XLA pass (gmm, act,
  gmm: the library before the activation moved into the kernels' epilogues), to measure the fusion.
The rows are placed the way moe_mlp places them (permute.dropless_placement with block_size=128),
outside the timed call; useful FLOPs count the N real rows, not the padding.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

import sparsejax as sj
from sparsejax import permute
from sparsejax.kernels import gmm as G
from sparsejax.kernels.gmm import resolve_backend
from sparsejax.topology import BLOCK_SIZE, make_topology

from peers.common import Case, Problem, Reference, compare, jax_case

IMPL_BACKEND = {"pallas": "auto", "mosaic": "mosaic", "triton": "triton", "mosaic_unfused": "mosaic"}


def topology(placement: permute.Placement):
  """make_topology for a dropless placement, passing the real row counts where it takes them."""
  if "group_sizes" in inspect.signature(make_topology).parameters:
    return make_topology(placement.group_sizes, placement.num_rows, BLOCK_SIZE,
                         group_sizes=placement.tokens_per_expert)
  return make_topology(placement.group_sizes, placement.num_rows, BLOCK_SIZE)


@functools.partial(jax.jit, static_argnums=1)
def _placements(ids, num_experts):
  padded = permute.dropless_placement(ids, num_experts, block_size=BLOCK_SIZE)
  return padded, topology(padded), permute.dropless_placement(ids, num_experts).rows


def padded_layout(p: Problem):
  """The block-padded placement, its topology and, for each sorted row, its row in the padded
  buffer (both placements put assignment (t, j) at its expert's offset plus the same rank)."""
  padded, topo, sorted_rows = _placements(p.ids, p.shape.E)
  order = np.argsort(np.asarray(sorted_rows).reshape(-1))
  return padded, topo, np.asarray(padded.rows).reshape(-1)[order]


@functools.partial(jax.jit, static_argnums=2)
def _place(values, pos, num_rows):
  return jnp.zeros((num_rows, values.shape[1]), values.dtype).at[pos].set(values)


def sparsejax_case(p: Problem, ref: Reference, impl: str) -> Case:
  """impl in ("pallas", "mosaic", "triton", "mosaic_unfused")."""
  s = p.shape
  placement, topo, pos = padded_layout(p)
  rows = _place(p.rows, pos, placement.num_rows)
  ct = _place(p.ct, pos, placement.num_rows)

  def ffn(rows, topo, w_in, w_out):
    if impl == "mosaic_unfused":
      h = jax.nn.gelu(G.gmm(rows, w_in, topo, backend="mosaic"))
      return G.gmm(h, w_out, topo, backend="mosaic")
    return sj.expert_ffn(rows, None, w_in, w_out, impl=impl, topology=topo)

  def check(y, grads):
    dx, dw_in, dw_out = grads
    return compare(y[pos], (dx[pos], dw_in, dw_out), ref)

  return jax_case(f"sparsejax_{impl}", ffn, (rows, topo, p.w_in, p.w_out), ct, s.N, check,
                  backend=resolve_backend(IMPL_BACKEND[impl]), padded_rows=placement.num_rows)
