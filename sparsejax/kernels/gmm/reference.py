"""The obviously-right grouped products every gmm backend is tested against (pure jnp, float32).

  gmm   out[r] = lhs[r] @ rhs[e(r)]            (rhs[e(r)]^T with transpose_rhs), for real rows r
  tgmm  out[e] = sum over real rows r of e: lhs[r]^T dout[r]
A row is real when it holds a token: among the first row_block_rows[b] rows of its block b (none
in blocks past the topology's active count). Other rows are zero in gmm and add nothing in tgmm.
A kernel's gmm output is defined on the rows of active blocks only (`written_rows`; op.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from sparsejax.topology import Topology

_HI = jax.lax.Precision.HIGHEST  # float32 on every backend (no TF32 on GPU)


def real_rows(topo: Topology):
  """[rows] bool: the row holds a token."""
  within = jnp.arange(topo.block_size)[None, :] < topo.row_block_rows[:, None]
  return within.reshape(-1)


def written_rows(topo: Topology):
  """[rows] bool: the row lies in an active block (one with a real row), where gmm's output is
  defined; a kernel may leave the rows of inactive blocks unwritten."""
  return jnp.repeat(topo.row_block_rows > 0, topo.block_size)


def gmm_reference(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "experts k n"] | Float[Array, "experts n k"],
    topo: Topology,
    transpose_rhs: bool = False,
    out_dtype=None,
) -> Float[Array, "rows n"]:
  """out[r] = lhs[r] @ rhs[e(r)] (or rhs[e(r)]^T), per row block, masked to real rows."""
  w = rhs[topo.row_block_expert].astype(jnp.float32)  # [blocks, K, N]
  if transpose_rhs:
    w = jnp.swapaxes(w, 1, 2)
  a = lhs.astype(jnp.float32).reshape(topo.num_row_blocks, topo.block_size, -1)
  out = jnp.einsum("bmk,bkn->bmn", a, w, precision=_HI).reshape(lhs.shape[0], -1)
  return jnp.where(real_rows(topo)[:, None], out, 0.0).astype(out_dtype or lhs.dtype)


def tgmm_reference(
    lhs: Float[Array, "rows k"], dout: Float[Array, "rows n"], topo: Topology, out_dtype=None
) -> Float[Array, "experts k n"]:
  """out[e] = sum_r [e(r) = e, r real] lhs[r]^T dout[r]."""
  rows_expert = jnp.repeat(topo.row_block_expert, topo.block_size)
  mask = jax.nn.one_hot(rows_expert, topo.num_experts) * real_rows(topo)[:, None]
  out = jnp.einsum("re,rk,rn->ekn", mask, lhs.astype(jnp.float32), dout.astype(jnp.float32),
                   precision=_HI)
  return out.astype(out_dtype or lhs.dtype)


def mlp_reference(
    lhs: Float[Array, "rows d_model"],
    w_in: Float[Array, "experts d_model d_ff"],
    w_out: Float[Array, "experts d_ff d_model"],
    topo: Topology,
    activation,
    w_gate: Float[Array, "experts d_model d_ff"] | None = None,
) -> Float[Array, "rows d_model"]:
  """y[r] = act(lhs[r] @ w_in[e(r)]) @ w_out[e(r)], or with w_gate the GLU form
  (act(lhs[r] @ w_gate[e(r)]) * (lhs[r] @ w_in[e(r)])) @ w_out[e(r)], for real rows, in float32
  (h rounded to lhs's dtype between the products, as every backend stores it)."""
  h = gmm_reference(lhs, w_in, topo, out_dtype=jnp.float32)
  if w_gate is None:
    h = activation(h)
  else:
    h = activation(gmm_reference(lhs, w_gate, topo, out_dtype=jnp.float32)) * h
  return gmm_reference(h.astype(lhs.dtype), w_out, topo, out_dtype=jnp.float32).astype(lhs.dtype)
