"""XLA baselines: what a competent JAX user writes without a grouped-matmul kernel.

balanced_bmm: the N rows cut into E equal groups, one batched einsum per product. Not the MoE
  (routing ignored), but the ceiling a grouped kernel aims at: same FLOPs, perfectly balanced.
capacity_einsum_cf{cf}: the Switch/GShard layout, C = ceil(cf * T * k / E) slots per expert,
  overflow dropped (useful FLOPs count kept rows only), empty slots computed on zeros.
ragged_dot: jax.lax.ragged_dot on the sorted rows.

All are plain bf16 products (no preferred_element_type): the matmul accumulates in float32 inside
and returns bf16, and the backward runs bf16 matmuls too. (An f32 preferred_element_type followed
by .astype(bf16) would make the backward run float32 matmuls: a handicapped baseline.)
"""
from __future__ import annotations

import functools

import jax

import sparsejax as sj
from sparsejax import permute

from peers.common import Case, Problem, Reference, batched_reference, compare, einsum_mm, jax_case, mlp


def _batched(rows, w_in, w_out):
  return mlp(einsum_mm, rows, w_in, w_out)


def balanced_bmm(p: Problem, ref: Reference) -> Case:
  s = p.shape
  n = (s.N // s.E) * s.E
  rows = p.rows[:n].reshape(s.E, n // s.E, s.d)
  ct = p.ct[:n].reshape(rows.shape)
  own_ref = batched_reference(rows, ct, p.w_in, p.w_out)
  return jax_case("balanced_bmm", _batched, (rows, p.w_in, p.w_out), ct, n,
                  lambda y, g: compare(y, g, own_ref))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _capacity_buffer(x, ids, num_experts, capacity):
  placement = permute.capacity_placement(ids, num_experts, capacity)
  return permute.gather_rows(x, placement), placement.num_dropped


def capacity_einsum(p: Problem, ref: Reference, cf: float) -> Case:
  s = p.shape
  c = sj.capacity(s.T, s.E, s.k, cf)
  buf, dropped = _capacity_buffer(p.x, p.ids, s.E, c)
  buf = buf.reshape(s.E, c, s.d)
  ct = jax.random.normal(jax.random.key(5), buf.shape, buf.dtype)
  dropped = int(dropped)
  own_ref = batched_reference(buf, ct, p.w_in, p.w_out)
  return jax_case(f"capacity_einsum_cf{cf}", _batched, (buf, p.w_in, p.w_out), ct, s.N - dropped,
                  lambda y, g: compare(y, g, own_ref), capacity_factor=cf, capacity=c,
                  dropped_fraction=dropped / s.N)


def _ragged(rows, group_sizes, w_in, w_out):
  return mlp(lambda a, w: jax.lax.ragged_dot(a, w, group_sizes), rows, w_in, w_out)


def ragged_dot(p: Problem, ref: Reference) -> Case:
  return jax_case("ragged_dot", _ragged, (p.rows, p.group_sizes, p.w_in, p.w_out), p.ct, p.shape.N,
                  lambda y, g: compare(y, g, ref))
