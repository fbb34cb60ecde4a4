"""The obviously-right grouped products every gmm backend is tested against (pure jnp, float32).

  gmm   out[r] = lhs[r] @ rhs[e(r)]            (rhs[e(r)]^T with transpose_rhs), rows of active blocks
  tgmm  out[e] = sum over active rows r of e: lhs[r]^T dout[r]
Rows of inactive blocks (past the topology's active count) are zero in gmm and add nothing in tgmm.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from sparsejax.topology import Topology

_HI = jax.lax.Precision.HIGHEST  # float32 on every backend (no TF32 on GPU)


def active_rows(topo: Topology):
  blocks = jnp.arange(topo.num_row_blocks)
  return jnp.repeat(blocks < topo.num_active_blocks[0], topo.block_size)


def gmm_reference(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "experts k n"] | Float[Array, "experts n k"],
    topo: Topology,
    transpose_rhs: bool = False,
    out_dtype=None,
) -> Float[Array, "rows n"]:
  """out[r] = lhs[r] @ rhs[e(r)] (or rhs[e(r)]^T), per row block, masked to active blocks."""
  w = rhs[topo.row_block_expert].astype(jnp.float32)  # [blocks, K, N]
  if transpose_rhs:
    w = jnp.swapaxes(w, 1, 2)
  a = lhs.astype(jnp.float32).reshape(topo.num_row_blocks, topo.block_size, -1)
  out = jnp.einsum("bmk,bkn->bmn", a, w, precision=_HI).reshape(lhs.shape[0], -1)
  return jnp.where(active_rows(topo)[:, None], out, 0.0).astype(out_dtype or lhs.dtype)


def tgmm_reference(
    lhs: Float[Array, "rows k"], dout: Float[Array, "rows n"], topo: Topology, out_dtype=None
) -> Float[Array, "experts k n"]:
  """out[e] = sum_r [e(r) = e, r active] lhs[r]^T dout[r]."""
  rows_expert = jnp.repeat(topo.row_block_expert, topo.block_size)
  mask = jax.nn.one_hot(rows_expert, topo.num_experts) * active_rows(topo)[:, None]
  out = jnp.einsum("re,rk,rn->ekn", mask, lhs.astype(jnp.float32), dout.astype(jnp.float32),
                   precision=_HI)
  return out.astype(out_dtype or lhs.dtype)
