"""The Pallas grouped-GEMM kernels (every backend) in interpret mode against their pure-jnp references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax as sj
from sparsejax.kernels import gmm as G
from sparsejax.kernels.gmm import triton as T
from sparsejax.topology import make_topology

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def topology_for(group_sizes, num_rows_bound=None, block=128):
  gs = np.asarray(group_sizes)
  padded = (gs + block - 1) // block * block
  rows = num_rows_bound or int(padded.sum()) + block  # one spare block, inactive
  return make_topology(jnp.asarray(padded, jnp.int32), rows, block)


# Group sizes (in rows of the padded layout, before padding): empty experts, everything on one
# expert, sizes that are not multiples of the block, a single expert.
GROUPS = [
    [130, 0, 5, 200],
    [0, 0, 300, 0],
    [1, 1, 1, 1],
    [257],
]


@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k,n", [(32, 48), (64, 16)])
def test_gmm_and_tgmm_match_reference(groups, dtype, k, n):
  seed = hash((tuple(groups), str(dtype), k, n)) % 2**31
  keys = jax.random.split(jax.random.key(seed), 4)
  topo = topology_for(groups)
  rows = topo.num_row_blocks * topo.block_size
  e = len(groups)
  lhs = jax.random.normal(keys[0], (rows, k), dtype)
  rhs = jax.random.normal(keys[1], (e, k, n), dtype)
  rhs_t = jax.random.normal(keys[2], (e, n, k), dtype)
  dout = jax.random.normal(keys[3], (rows, n), dtype)

  out = G.gmm(lhs, rhs, topo)
  assert out.dtype == dtype and out.shape == (rows, n)
  assert rel_err(out, G.gmm_reference(lhs, rhs, topo)) < TOL[dtype]
  # Inactive blocks (the spare one at the end) are exactly zero.
  active = int(topo.num_active_blocks[0]) * topo.block_size
  assert np.all(np.asarray(out[active:]) == 0)

  out_t = G.gmm(lhs, rhs_t, topo, transpose_rhs=True)
  assert rel_err(out_t, G.gmm_reference(lhs, rhs_t, topo, transpose_rhs=True)) < TOL[dtype]

  dw = G.tgmm(lhs, dout, topo)
  ref = G.tgmm_reference(lhs, dout, topo)
  assert dw.shape == (e, k, n)
  assert rel_err(dw, ref) < TOL[dtype]
  empty = [i for i, g in enumerate(groups) if g == 0]
  assert np.all(np.asarray(dw)[empty] == 0)


@pytest.mark.parametrize("groups", GROUPS[:2])
def test_gmm_gradients_match_reference(groups):
  keys = jax.random.split(jax.random.key(len(groups) + sum(groups)), 3)
  topo = topology_for(groups)
  rows = topo.num_row_blocks * topo.block_size
  lhs = jax.random.normal(keys[0], (rows, 32))
  rhs = jax.random.normal(keys[1], (len(groups), 32, 16))
  ct = jax.random.normal(keys[2], (rows, 16))
  loss = lambda f: lambda a, b: jnp.sum(jnp.tanh(f(a, b, topo)) * ct)
  g = jax.grad(loss(G.gmm), argnums=(0, 1))(lhs, rhs)
  g_ref = jax.grad(loss(G.gmm_reference), argnums=(0, 1))(lhs, rhs)
  for a, b in zip(g, g_ref):
    assert rel_err(a, b) < 2e-5


@pytest.mark.parametrize("group_sizes,m", [([100, 0, 50, 120], 300), ([0, 37, 0, 0], 37),
                                           ([5], 9), ([3, 4, 2], 9)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_matmul_pallas_has_ragged_dot_semantics(group_sizes, m, dtype):
  keys = jax.random.split(jax.random.key(m + len(group_sizes)), 3)
  gs = jnp.asarray(group_sizes, jnp.int32)
  lhs = jax.random.normal(keys[0], (m, 24), dtype)  # K=24: exercises padding to the tile
  rhs = jax.random.normal(keys[1], (len(group_sizes), 24, 40), dtype)
  out = sj.grouped_matmul(lhs, rhs, gs, impl="pallas")
  ref = sj.grouped_matmul(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs, impl="reference")
  assert out.dtype == dtype
  assert rel_err(out, ref) < TOL[dtype]
  tail = int(gs.sum())
  assert np.all(np.asarray(out[tail:]) == 0)  # rows past the groups are zero
  ct = jax.random.normal(keys[2], (m, 40))
  loss = lambda impl: lambda a, b: jnp.sum(sj.grouped_matmul(a, b, gs, impl=impl).astype(jnp.float32) * ct)
  g = jax.grad(loss("pallas"), argnums=(0, 1))(lhs, rhs)
  g_ref = jax.grad(loss("reference"), argnums=(0, 1))(lhs.astype(jnp.float32), rhs.astype(jnp.float32))
  for a, b in zip(g, g_ref):
    assert rel_err(a, b) < TOL[dtype]


def test_topology_is_block_csr_of_the_padded_layout():
  topo = topology_for([130, 0, 5, 200], num_rows_bound=6 * 128)
  np.testing.assert_array_equal(topo.row_block_expert, [0, 0, 2, 3, 3, 3])
  np.testing.assert_array_equal(topo.expert_block_offsets, [0, 2, 2, 3, 5])
  assert int(topo.num_active_blocks[0]) == 5
  with pytest.raises(ValueError, match="multiple of block_size"):
    make_topology(jnp.array([128]), 130, 128)


def test_gmm_rejects_mismatched_topology():
  topo = topology_for([10, 20])
  with pytest.raises(ValueError, match="rows"):
    G.gmm(jnp.zeros((100, 16)), jnp.zeros((2, 16, 16)), topo)
  with pytest.raises(ValueError, match="experts"):
    G.gmm(jnp.zeros((topo.num_row_blocks * 128, 16)), jnp.zeros((3, 16, 16)), topo)
