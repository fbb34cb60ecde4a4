"""The Pallas-Triton backend of gmm / tgmm: any CUDA GPU (the Hopper backend is mosaic.py beside it).

Grouped GEMM over the padded block layout: MegaBlocks' SDD / DSD and their transposes.

On the block-diagonal topology (sparsejax/topology.py) each block-sparse product is one of two
kernels:
  gmm   out[r-block] = lhs[r-block] @ rhs[e(r)]        SDD (X W_in -> H, its non-zero blocks stored
                                                        as dense row blocks), DSD (H W_out -> Y)
  gmm   with transpose_rhs: lhs[r-block] @ rhs[e(r)]^T  D S D^T (dX = dH W_in^T, dH = dY W_out^T)
  tgmm  out[e] = sum over e's row blocks lhs^T @ dout    DS^T D (dW_in = X^T dH, dW_out = H^T dY)
The custom_vjp that wires them together is in op.py; the references in reference.py; tests in
tests/test_gmm_kernels.py (interpret mode on the CPU).
Row blocks past the active ones skip their K loop and write zeros, so the static bound on the
buffer costs no arithmetic; rows that hold no token (topology.row_block_rows) are zero in gmm's
output and masked out of tgmm's sum.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from sparsejax._precision import dot_precision
from sparsejax import kernels  # read when called, so the GPU's generation can be set in a test
from sparsejax.kernels.gmm.padding import pad_to
from sparsejax.kernels.shared_lowering import shared_lowering
from sparsejax.topology import Topology


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Tile sizes and Triton launch settings (the row tile is the topology's block size)."""
  # Defaults: the fastest of the Triton tiling sweep on an H100
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


def _for_dtype(tiling: Tiling, dtype, block_m: int = 128) -> Tiling:
  """float32 tiles take twice the shared memory of bf16 ones: halve the wide ones so a pipelined
  K loop fits in the 227 KiB of an H100 (the bf16 defaults asked for 288 KiB at float32). Then, on a
  GPU with less shared memory a block than an H100, fit_shared_memory. (The defaults ask 144 KiB for gmm and
  192 KiB for tgmm in bf16: more than an A100 allows tgmm, and than a 99 KiB card allows either.)"""
  if jnp.dtype(dtype).itemsize >= 4:
    tiling = dataclasses.replace(tiling, block_n=min(tiling.block_n, 128),
                                 tgmm_block_k=min(tiling.tgmm_block_k, 64),
                                 tgmm_block_n=min(tiling.tgmm_block_n, 128))
  limit = kernels.shared_memory_limit()
  return tiling if limit is None else fit_shared_memory(tiling, jnp.dtype(dtype).itemsize, limit, block_m)


def pipeline_bytes(block_m: int, block_k: int, block_n: int, num_stages: int, itemsize: int, *, tgmm: bool) -> int:
  """Shared memory of a kernel's pipelined K loop: num_stages buffers of its two operand tiles. gmm loads lhs
  [block_m, block_k] and rhs [block_k, block_n]; tgmm lhs [block_m, block_k] and dout [block_m, block_n]. (On an
  H100, Triton asked 288 KiB for gmm's bf16 defaults at float32: 3 * (128 * 64 + 64 * 256) * 4 bytes.)"""
  return num_stages * (block_m * block_k + (block_m if tgmm else block_k) * block_n) * itemsize


def fit_shared_memory(tiling: Tiling, itemsize: int, limit: int, block_m: int = 128) -> Tiling:
  """The tiling, shrunk until each kernel's pipeline fits `limit` bytes: gmm first drops a stage (to 2), then
  halves block_n (to 64), then block_k (to 32); tgmm halves its block_n (to 64), then block_k (to 32), then
  drops stages (to 1). A tiling that fits comes back unchanged."""
  t = tiling
  gmm_bytes = lambda t: pipeline_bytes(block_m, t.block_k, t.block_n, t.num_stages, itemsize, tgmm=False)
  while gmm_bytes(t) > limit:
    if t.num_stages > 2:
      t = dataclasses.replace(t, num_stages=t.num_stages - 1)
    elif t.block_n > 64:
      t = dataclasses.replace(t, block_n=t.block_n // 2)
    elif t.block_k > 32:
      t = dataclasses.replace(t, block_k=t.block_k // 2)
    else:
      break
  tgmm_bytes = lambda t: pipeline_bytes(block_m, t.tgmm_block_k, t.tgmm_block_n, t.tgmm_num_stages, itemsize,
                                        tgmm=True)
  while tgmm_bytes(t) > limit:
    if t.tgmm_block_n > 64:
      t = dataclasses.replace(t, tgmm_block_n=t.tgmm_block_n // 2)
    elif t.tgmm_block_k > 32:
      t = dataclasses.replace(t, tgmm_block_k=t.tgmm_block_k // 2)
    elif t.tgmm_num_stages > 1:
      t = dataclasses.replace(t, tgmm_num_stages=t.tgmm_num_stages - 1)
    else:
      break
  return t


def _interpret() -> bool:
  return jax.default_backend() != "gpu"


def _compiler_params(num_warps, num_stages):
  from jax.experimental.pallas import triton as plt

  return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _tile(dim: int, preferred: int) -> int:
  """A power-of-two tile no larger than needed (and at least 16, Triton's smallest dot)."""
  return max(16, min(preferred, pl.next_power_of_2(dim)))


# ----------------------------------------------------------------------------------------------
# gmm: out[R, N] = lhs[R, K] @ rhs[e(r)]   (rhs [E, K, N], or [E, N, K] with transpose_rhs)
# ----------------------------------------------------------------------------------------------
def _gmm_kernel(row_block_expert_ref, row_block_rows_ref, lhs_ref, rhs_ref, out_ref, *,
                block_m, block_n, block_k, num_k_steps, transpose_rhs, precision):
  i, j = pl.program_id(0), pl.program_id(1)
  expert = row_block_expert_ref[i]
  num_real = row_block_rows_ref[i]
  active = num_real > 0
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
    real = jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0) < num_real
    out_ref[...] = jnp.where(real, acc, 0.0).astype(out_ref.dtype)

  @pl.when(jnp.logical_not(active))
  def _():
    out_ref[...] = jnp.zeros((block_m, block_n), out_ref.dtype)


def gmm(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "experts k n"] | Float[Array, "experts n k"],
    topo: Topology,
    transpose_rhs: bool,
    out_dtype,
    tiling: Tiling | None = None,
) -> Float[Array, "rows n"]:
  """out[r] = lhs[r] @ rhs[e(r)] (rhs[e(r)]^T with transpose_rhs); zero rows past the active blocks."""
  tiling = _for_dtype(tiling or DEFAULT_TILING, lhs.dtype, topo.block_size)
  k = lhs.shape[1]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  block_m = topo.block_size
  block_n, block_k = _tile(n, tiling.block_n), _tile(k, tiling.block_k)
  lhs_p = pad_to(lhs, 1, block_k)
  if transpose_rhs:
    rhs_p = pad_to(pad_to(rhs, 1, block_n), 2, block_k)
  else:
    rhs_p = pad_to(pad_to(rhs, 1, block_k), 2, block_n)
  out = _gmm_padded(topo.row_block_expert, topo.row_block_rows, lhs_p, rhs_p, block_m=block_m, block_n=block_n,
                    block_k=block_k, transpose_rhs=transpose_rhs, out_dtype=jnp.dtype(out_dtype),
                    num_warps=tiling.num_warps, num_stages=tiling.num_stages, interpret=_interpret())
  return out[:, :n]


# One lowering per program for the layers' alike calls (shared_lowering.py); the topology is traced.
@shared_lowering("block_m", "block_n", "block_k", "transpose_rhs", "out_dtype", "num_warps", "num_stages")
def _gmm_padded(row_block_expert, row_block_rows, lhs_p, rhs_p, *, block_m, block_n, block_k, transpose_rhs,
                out_dtype, num_warps, num_stages, interpret):
  """gmm on operands already padded to the tiles: [rows, n_p]."""
  n_p = rhs_p.shape[1] if transpose_rhs else rhs_p.shape[2]
  kernel = functools.partial(
      _gmm_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
      num_k_steps=lhs_p.shape[1] // block_k, transpose_rhs=transpose_rhs,
      precision=dot_precision(lhs_p.dtype))
  return pl.pallas_call(
      kernel,
      grid=(lhs_p.shape[0] // block_m, n_p // block_n),
      in_specs=[pl.no_block_spec] * 4,
      out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((lhs_p.shape[0], n_p), out_dtype),
      interpret=interpret,
      compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
      name="sparsejax_gmm_t" if transpose_rhs else "sparsejax_gmm",
  )(row_block_expert, row_block_rows, lhs_p, rhs_p)


# ----------------------------------------------------------------------------------------------
# tgmm: out[e] = sum over row blocks r of expert e of lhs[r]^T @ dout[r]   ([E, K, N])
# ----------------------------------------------------------------------------------------------
def _tgmm_kernel(offsets_ref, row_block_rows_ref, lhs_ref, dout_ref, out_ref, *, block_m, block_k,
                 block_n, precision):
  e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
  ns = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)

  def step(r, acc):
    rows = pl.ds(pl.multiple_of(r * block_m, block_m), block_m)
    a = lhs_ref[rows, ks]
    real = jax.lax.broadcasted_iota(jnp.int32, (block_m, block_k), 0) < row_block_rows_ref[r]
    a = jnp.where(real, a, jnp.zeros_like(a))
    # dout too: a zero a-row times a NaN or inf g-row would still be NaN (op.tgmm's contract).
    g = dout_ref[rows, ns]
    real_g = jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0) < row_block_rows_ref[r]
    g = jnp.where(real_g, g, jnp.zeros_like(g))
    return acc + jax.lax.dot_general(a, g, (((0,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(offsets_ref[e], offsets_ref[e + 1], step,
                          jnp.zeros((block_k, block_n), jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def tgmm(
    lhs: Float[Array, "rows k"],
    dout: Float[Array, "rows n"],
    topo: Topology,
    out_dtype,
    tiling: Tiling | None = None,
) -> Float[Array, "experts k n"]:
  """out[e] = lhs[rows of e]^T @ dout[rows of e]: the weight gradient (MegaBlocks' DS^T D); f32 accumulate."""
  tiling = _for_dtype(tiling or DEFAULT_TILING, lhs.dtype, topo.block_size)
  k, n = lhs.shape[1], dout.shape[1]
  block_k, block_n = _tile(k, tiling.tgmm_block_k), _tile(n, tiling.tgmm_block_n)
  lhs_p, dout_p = pad_to(lhs, 1, block_k), pad_to(dout, 1, block_n)
  out = _tgmm_padded(topo.expert_block_offsets, topo.row_block_rows, lhs_p, dout_p, block_m=topo.block_size,
                     block_k=block_k, block_n=block_n, out_dtype=jnp.dtype(out_dtype),
                     num_warps=tiling.tgmm_num_warps, num_stages=tiling.tgmm_num_stages, interpret=_interpret())
  return out[:, :k, :n]


@shared_lowering("block_m", "block_k", "block_n", "out_dtype", "num_warps", "num_stages")
def _tgmm_padded(expert_block_offsets, row_block_rows, lhs_p, dout_p, *, block_m, block_k, block_n, out_dtype,
                 num_warps, num_stages, interpret):
  """tgmm on operands already padded to the tiles: [E, k_p, n_p]; E = len(expert_block_offsets) - 1."""
  num_experts = expert_block_offsets.shape[0] - 1
  kernel = functools.partial(_tgmm_kernel, block_m=block_m, block_k=block_k, block_n=block_n,
                             precision=dot_precision(lhs_p.dtype))
  return pl.pallas_call(
      kernel,
      grid=(num_experts, lhs_p.shape[1] // block_k, dout_p.shape[1] // block_n),
      in_specs=[pl.no_block_spec] * 4,
      out_specs=pl.BlockSpec((None, block_k, block_n), lambda e, i, j: (e, i, j)),
      out_shape=jax.ShapeDtypeStruct((num_experts, lhs_p.shape[1], dout_p.shape[1]), out_dtype),
      interpret=interpret,
      compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
      name="sparsejax_tgmm",
  )(expert_block_offsets, row_block_rows, lhs_p, dout_p)
