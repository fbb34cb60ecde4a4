"""Grouped GEMM over the padded block layout: MegaBlocks' SDD / DSD and their transposes.

On the block-diagonal topology (sparsejax/topology.py) each block-sparse product is one of two
kernels:
  gmm   out[r-block] = lhs[r-block] @ rhs[e(r)]        SDD (X W_in -> H, its non-zero blocks stored
                                                        as dense row blocks), DSD (H W_out -> Y)
  gmm   with transpose_rhs: lhs[r-block] @ rhs[e(r)]^T  D S D^T (dX = dH W_in^T, dH = dY W_out^T)
  tgmm  out[e] = sum over e's row blocks lhs^T @ dout    DS^T D (dW_in = X^T dH, dW_out = H^T dY)
`gmm` carries the custom_vjp that wires them together. References: `gmm_reference` and
`tgmm_reference` below (pure jnp), tested in interpret mode in tests/test_pallas_gmm.py.
Row blocks past the active ones skip their K loop and write zeros, so the static bound on the
buffer costs no arithmetic.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from sparsejax.topology import BLOCK_SIZE, Topology, make_topology


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Tile sizes and Triton launch settings (the row tile is the topology's block size)."""
  # Defaults: the fastest of the sweep in experiments/bench_moe_layer.py --sweep on an H100
  # (T=16384, d=1024, f=4096, E=64; results in experiments/results/moe_layer_*.json).
  block_n: int = 256
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3
  tgmm_block_k: int = 128
  tgmm_block_n: int = 256
  tgmm_num_warps: int = 8
  tgmm_num_stages: int = 2


DEFAULT_TILING = Tiling()


def _interpret() -> bool:
  return jax.default_backend() != "gpu"


def _compiler_params(num_warps, num_stages):
  from jax.experimental.pallas import triton as plt

  return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _tile(dim: int, preferred: int) -> int:
  """A power-of-two tile no larger than needed (and at least 16, Triton's smallest dot)."""
  return max(16, min(preferred, pl.next_power_of_2(dim)))


def _pad_to(x, axis: int, multiple: int):
  pad = (-x.shape[axis]) % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _precision(dtype):
  # float32 operands: full-precision products, not TF32, so float32 users get float32 answers.
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


# ----------------------------------------------------------------------------------------------
# gmm: out[R, N] = lhs[R, K] @ rhs[e(r)]   (rhs [E, K, N], or [E, N, K] with transpose_rhs)
# ----------------------------------------------------------------------------------------------
def _gmm_kernel(row_block_expert_ref, num_active_ref, lhs_ref, rhs_ref, out_ref, *,
                block_m, block_n, block_k, num_k_steps, transpose_rhs, precision):
  i, j = pl.program_id(0), pl.program_id(1)
  expert = row_block_expert_ref[i]
  active = i < num_active_ref[0]
  rows = pl.ds(pl.multiple_of(i * block_m, block_m), block_m)
  cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)

  def step(s, acc):
    ks = pl.ds(pl.multiple_of(s * block_k, block_k), block_k)
    a = lhs_ref[rows, ks]
    if transpose_rhs:
      b = rhs_ref[expert, cols, ks]
      dims = (((1,), (1,)), ((), ()))
    else:
      b = rhs_ref[expert, ks, cols]
      dims = (((1,), (0,)), ((), ()))
    return acc + jax.lax.dot_general(a, b, dims, precision=precision,
                                     preferred_element_type=jnp.float32)

  # A static trip count (not one that is zero for inactive blocks) keeps Triton's software
  # pipelining; inactive blocks branch around the loop instead.
  @pl.when(active)
  def _():
    acc = jax.lax.fori_loop(0, num_k_steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)

  @pl.when(jnp.logical_not(active))
  def _():
    out_ref[...] = jnp.zeros((block_m, block_n), out_ref.dtype)


def _gmm_call(lhs, rhs, topo: Topology, transpose_rhs: bool, tiling: Tiling):
  num_rows, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  block_m = topo.block_size
  block_n, block_k = _tile(n, tiling.block_n), _tile(k, tiling.block_k)
  lhs_p = _pad_to(lhs, 1, block_k)
  if transpose_rhs:
    rhs_p = _pad_to(_pad_to(rhs, 1, block_n), 2, block_k)
  else:
    rhs_p = _pad_to(_pad_to(rhs, 1, block_k), 2, block_n)
  n_p = -(-n // block_n) * block_n
  kernel = functools.partial(
      _gmm_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
      num_k_steps=lhs_p.shape[1] // block_k, transpose_rhs=transpose_rhs,
      precision=_precision(lhs.dtype))
  out = pl.pallas_call(
      kernel,
      grid=(num_rows // block_m, n_p // block_n),
      in_specs=[pl.no_block_spec] * 4,
      out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((num_rows, n_p), lhs.dtype),
      interpret=_interpret(),
      compiler_params=None if _interpret() else _compiler_params(tiling.num_warps, tiling.num_stages),
      name="sparsejax_gmm_t" if transpose_rhs else "sparsejax_gmm",
  )(topo.row_block_expert, topo.num_active_blocks, lhs_p, rhs_p)
  return out[:, :n]


# ----------------------------------------------------------------------------------------------
# tgmm: out[e] = sum over row blocks r of expert e of lhs[r]^T @ dout[r]   ([E, K, N])
# ----------------------------------------------------------------------------------------------
def _tgmm_kernel(offsets_ref, lhs_ref, dout_ref, out_ref, *, block_m, block_k, block_n, precision):
  e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
  ns = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)

  def step(r, acc):
    rows = pl.ds(pl.multiple_of(r * block_m, block_m), block_m)
    a = lhs_ref[rows, ks]
    g = dout_ref[rows, ns]
    return acc + jax.lax.dot_general(a, g, (((0,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(offsets_ref[e], offsets_ref[e + 1], step,
                          jnp.zeros((block_k, block_n), jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def tgmm(
    lhs: Float[Array, "rows k"],
    dout: Float[Array, "rows n"],
    topo: Topology,
    tiling: Tiling = DEFAULT_TILING,
) -> Float[Array, "experts k n"]:
  """out[e] = lhs[rows of e]^T @ dout[rows of e]: the weight gradient (MegaBlocks' DS^T D); f32 accumulate."""
  k, n = lhs.shape[1], dout.shape[1]
  block_k, block_n = _tile(k, tiling.tgmm_block_k), _tile(n, tiling.tgmm_block_n)
  lhs_p, dout_p = _pad_to(lhs, 1, block_k), _pad_to(dout, 1, block_n)
  kernel = functools.partial(_tgmm_kernel, block_m=topo.block_size, block_k=block_k,
                             block_n=block_n, precision=_precision(lhs.dtype))
  out = pl.pallas_call(
      kernel,
      grid=(topo.num_experts, lhs_p.shape[1] // block_k, dout_p.shape[1] // block_n),
      in_specs=[pl.no_block_spec] * 3,
      out_specs=pl.BlockSpec((None, block_k, block_n), lambda e, i, j: (e, i, j)),
      out_shape=jax.ShapeDtypeStruct((topo.num_experts, lhs_p.shape[1], dout_p.shape[1]), lhs.dtype),
      interpret=_interpret(),
      compiler_params=None if _interpret() else _compiler_params(
          tiling.tgmm_num_warps, tiling.tgmm_num_stages),
      name="sparsejax_tgmm",
  )(topo.expert_block_offsets, lhs_p, dout_p)
  return out[:, :k, :n]


# ----------------------------------------------------------------------------------------------
# The differentiable op.
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs, rhs, topo, tiling):
  return _gmm_call(lhs, rhs, topo, False, tiling)


def _gmm_fwd(lhs, rhs, topo, tiling):
  return _gmm_call(lhs, rhs, topo, False, tiling), (lhs, rhs, topo)


def _gmm_bwd(tiling, res, dout):
  lhs, rhs, topo = res
  dout = dout.astype(lhs.dtype)
  dlhs = _gmm_call(dout, rhs, topo, True, tiling)
  drhs = tgmm(lhs, dout, topo, tiling)
  return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "experts k n"],
    topo: Topology,
    tiling: Tiling | None = None,
) -> Float[Array, "rows n"]:
  """out[r] = lhs[r] @ rhs[e(r)] for rows of active blocks, zero past them; differentiable in lhs, rhs.

  tiling=None uses DEFAULT_TILING, read at call time so a benchmark's autotune can set it.
  """
  tiling = tiling or DEFAULT_TILING
  if lhs.shape[0] != topo.num_row_blocks * topo.block_size:
    raise ValueError(f"lhs has {lhs.shape[0]} rows; the topology covers "
                     f"{topo.num_row_blocks} blocks of {topo.block_size}.")
  if rhs.shape[0] != topo.num_experts:
    raise ValueError(f"rhs has {rhs.shape[0]} experts; the topology has {topo.num_experts}.")
  return _gmm(lhs, rhs, topo, tiling)


# ----------------------------------------------------------------------------------------------
# References (pure jnp, float32) the kernels are tested against.
# ----------------------------------------------------------------------------------------------
_HI = jax.lax.Precision.HIGHEST  # references are float32 on every backend (no TF32 on GPU)


def _active_rows(topo: Topology):
  blocks = jnp.arange(topo.num_row_blocks)
  return jnp.repeat(blocks < topo.num_active_blocks[0], topo.block_size)


def gmm_reference(lhs, rhs, topo: Topology, transpose_rhs: bool = False):
  """out[r] = lhs[r] @ rhs[e(r)] (or rhs[e(r)]^T), per row block, masked to active blocks."""
  w = rhs[topo.row_block_expert].astype(jnp.float32)  # [blocks, K, N]
  if transpose_rhs:
    w = jnp.swapaxes(w, 1, 2)
  a = lhs.astype(jnp.float32).reshape(topo.num_row_blocks, topo.block_size, -1)
  out = jnp.einsum("bmk,bkn->bmn", a, w, precision=_HI).reshape(lhs.shape[0], -1)
  return jnp.where(_active_rows(topo)[:, None], out, 0.0).astype(lhs.dtype)


def tgmm_reference(lhs, dout, topo: Topology):
  """out[e] = sum_r [e(r) = e, r active] lhs[r]^T dout[r]."""
  rows_expert = jnp.repeat(topo.row_block_expert, topo.block_size)
  mask = jax.nn.one_hot(rows_expert, topo.num_experts) * _active_rows(topo)[:, None]
  out = jnp.einsum("re,rk,rn->ekn", mask, lhs.astype(jnp.float32), dout.astype(jnp.float32),
                   precision=_HI)
  return out.astype(lhs.dtype)


# ----------------------------------------------------------------------------------------------
# grouped_matmul's "pallas" backend for arbitrary (unpadded) group sizes.
# ----------------------------------------------------------------------------------------------
def grouped_matmul_pallas(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "groups k n"],
    group_sizes: Int[Array, "groups"],
    *,
    block_size: int = BLOCK_SIZE,
    tiling: Tiling = DEFAULT_TILING,
) -> Float[Array, "rows n"]:
  """ragged_dot semantics through the padded kernels: rows moved into block-padded groups and back."""
  from sparsejax.permute import dropless_num_rows

  num_rows, num_groups = lhs.shape[0], rhs.shape[0]
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  padded = (group_sizes + block_size - 1) // block_size * block_size
  padded_starts = jnp.cumsum(padded) - padded
  row = jnp.arange(num_rows, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), num_groups - 1)
  valid = row < ends[-1]
  rows_bound = dropless_num_rows(num_rows, num_groups, block_size)
  dest = jnp.where(valid, padded_starts[group] + row - starts[group], rows_bound)
  src = jnp.full((rows_bound,), num_rows, jnp.int32).at[dest].set(row, mode="drop")
  lhs_ext = jnp.concatenate([lhs, jnp.zeros((1, lhs.shape[1]), lhs.dtype)])
  topo = make_topology(padded, rows_bound, block_size)
  out = gmm(lhs_ext[src], rhs, topo, tiling)
  out_ext = jnp.concatenate([out, jnp.zeros((1, out.shape[1]), out.dtype)])
  return out_ext[dest]
