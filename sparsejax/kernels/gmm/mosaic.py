"""The Hopper (sm_90) backend of gmm / tgmm, in Pallas Mosaic GPU.

Each kernel is persistent (one CTA per SM walks the output tiles) and warp-specialized: a
producer warpgroup streams operand tiles in with TMA through a `max_concurrent_steps`-deep
shared-memory ring, two consumer warpgroups run wgmma on them, each owning half of the CTA's
N tile, and write their accumulators back through shared memory with TMA stores that overlap
the next tile's loads.

Because every 128-row block of the padded layout belongs to one expert (sparsejax/topology.py),
a CTA tile never spans two experts: gmm reads one expert's weight tile per output tile, and
tgmm reduces over whole row blocks of one expert. Nothing is computed twice and nothing is
masked (unlike jax's ragged_dot_mgpu, which recomputes tiles that straddle a group boundary).
Inactive row blocks, and experts with no rows, run a pipeline of zero steps, so they store the
zero accumulator: the output is fully written with no separate memset.

The tile order is `planar_snake` over (row tiles, column tiles): with minor dimension M and a
width of about one expert's row blocks, the CTAs in flight share each expert's weight tiles
and row tiles in L2.

Contract and custom_vjp: op.py. Reference: reference.py. Float32 operands go to the Triton
backend: wgmma reads float32 as TF32, and float32 users get float32 answers.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from sparsejax.topology import Topology

M_DIM, N_DIM = 0, 1


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles of one kernel. The CTA tile is block_m x (2 * tile_n): one tile_n per consumer warpgroup."""
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 3
  epi_tile_n: int = 64
  grid_minor_dim: int = M_DIM
  grid_tile_width: int = 2


@dataclasses.dataclass(frozen=True)
class Configs:
  gmm: Config = Config()
  gmm_t: Config = Config()
  tgmm: Config = Config(tile_k=64, grid_minor_dim=N_DIM, grid_tile_width=1)


# Read at call time, so a benchmark's tuning can set it.
DEFAULT_CONFIGS = Configs()


def _interpret():
  if jax.default_backend() == "gpu":
    return None
  try:
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams  # public from some version on
  except ImportError:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def _num_sms() -> int:
  if jax.default_backend() != "gpu":
    return 4  # interpret mode: a few "SMs" so the persistent loop takes several tiles each
  return jax.devices()[0].core_count


def _transforms(minor_elems: int, dtype):
  swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


def _pad_to(x, axis: int, multiple: int):
  pad = (-x.shape[axis]) % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _fit(cfg: Config, k: int, n: int) -> Config:
  """Shrink tiles for small problems: tile_k and tile_n to 64 when the dimension is that small,
  and no more pipeline slots than there are K steps."""
  tile_k = min(cfg.tile_k, max(64, pl.next_power_of_2(k)))
  tile_n = min(cfg.tile_n, max(64, pl.next_power_of_2(n) // 2))
  return dataclasses.replace(cfg, tile_k=tile_k, tile_n=tile_n,
                             epi_tile_n=min(cfg.epi_tile_n, tile_n))


def _store_tile(acc, out_smem, out_ref, wg_idx, block_m, tile_n, epi_tile_n):
  """Write one consumer's [block_m, tile_n] accumulator to out_ref[:, its half] via smem + TMA,
  in epi_tile_n-wide pieces through two smem slots, so a store overlaps the next conversion."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  for j in range(tile_n // epi_tile_n):
    cols = slice(j * epi_tile_n, (j + 1) * epi_tile_n)
    slot = j % 2
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    out_smem[wg_idx, slot] = acc[:, cols]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        out_smem.at[wg_idx, slot],
        out_ref.at[:, pl.ds(wg_idx * tile_n + j * epi_tile_n, epi_tile_n)])


def _warp_specialized(body, grid, in_specs, cfg, compute_context):
  return plgpu.emit_pipeline_warp_specialized(
      body, grid=grid, memory_registers=40, in_specs=in_specs, wg_axis="wg",
      num_compute_wgs=2, max_concurrent_steps=cfg.max_concurrent_steps,
      compute_context=compute_context)


def _launch(body, out_shape, *args):
  return plgpu.kernel(
      body, out_type=out_shape, grid=(_num_sms(),), grid_names=("sm",), num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret(),
  )(*args)


# ----------------------------------------------------------------------------------------------
# gmm: out[r] = lhs[r] @ rhs[e(r)] (or rhs[e(r)]^T)
# ----------------------------------------------------------------------------------------------
def _gmm_padded(lhs, rhs, row_block_expert, num_active, *, block_m, transpose_rhs, out_dtype,
                cfg: Config):
  rows, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tile_n, tile_k, epi_tile_n = cfg.tile_n, cfg.tile_k, cfg.epi_tile_n
  cta_n = 2 * tile_n
  m_iters, n_iters, k_iters = rows // block_m, n // cta_n, k // tile_k
  cfg = dataclasses.replace(cfg, max_concurrent_steps=min(cfg.max_concurrent_steps, k_iters))
  dtype = lhs.dtype
  a_spec = plgpu.BlockSpec((block_m, tile_k), lambda s: (0, s), transforms=_transforms(tile_k, dtype))
  if transpose_rhs:
    b_spec = plgpu.BlockSpec((cta_n, tile_k), lambda s: (0, s), transforms=_transforms(tile_k, dtype))
  else:
    b_spec = plgpu.BlockSpec((tile_k, cta_n), lambda s: (s, 0), transforms=_transforms(cta_n, dtype))
  out_transforms = _transforms(epi_tile_n, out_dtype)

  def body(rbe_gmem, nact_gmem, lhs_gmem, rhs_gmem, out_gmem):
    ignore = lambda *_, **__: None
    allocs = _warp_specialized(ignore, (k_iters,), [a_spec, b_spec], cfg, ignore).get_allocations(
        lhs_gmem.at[pl.ds(0, block_m), :],
        rhs_gmem.at[0, pl.ds(0, cta_n), :] if transpose_rhs else rhs_gmem.at[0, :, pl.ds(0, cta_n)])

    @functools.partial(
        pl.run_scoped, pipeline_allocs=allocs,
        out_smem=plgpu.SMEM((2, 2, block_m, epi_tile_n), out_dtype, transforms=out_transforms),
        collective_axes="wg")
    def _scope(pipeline_allocs, out_smem):
      wg_idx = lax.axis_index("wg")

      @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
      def _tile(info):
        m_idx, n_idx = plgpu.planar_snake(
            info.index[0], (m_iters, n_iters), cfg.grid_minor_dim, cfg.grid_tile_width)
        expert = rbe_gmem[m_idx]
        # Inactive blocks run zero K steps and store the zero accumulator.
        steps = jnp.where(m_idx < nact_gmem[0], k_iters, 0)
        m_slice = pl.ds(m_idx * block_m, block_m)
        n_slice = pl.ds(n_idx * cta_n, cta_n)
        wg_n = pl.ds(wg_idx * tile_n, tile_n)

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((block_m, tile_n), jnp.float32))
          def _acc(acc_ref):
            eval_pipeline(acc_ref)
            _store_tile(acc_ref[...].astype(out_dtype), out_smem, out_gmem.at[m_slice, n_slice],
                        wg_idx, block_m, tile_n, epi_tile_n)

        def mma(_, a_smem, b_smem, acc_ref):
          if transpose_rhs:
            b = plgpu.transpose_ref(b_smem.at[wg_n, :], (1, 0))
          else:
            b = b_smem.at[:, wg_n]
          plgpu.wgmma(acc_ref, a_smem, b)
          plgpu.wgmma_wait(0)
          return acc_ref

        w = rhs_gmem.at[expert]
        _warp_specialized(mma, (steps,), [a_spec, b_spec], cfg, compute_context)(
            lhs_gmem.at[m_slice, :], w.at[n_slice, :] if transpose_rhs else w.at[:, n_slice],
            allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return _launch(body, jax.ShapeDtypeStruct((rows, n), out_dtype),
                 row_block_expert, num_active, lhs, rhs)


def gmm(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "experts k n"] | Float[Array, "experts n k"],
    topo: Topology,
    transpose_rhs: bool,
    out_dtype,
    configs: Configs | None = None,
) -> Float[Array, "rows n"]:
  """out[r] = lhs[r] @ rhs[e(r)] (rhs[e(r)]^T with transpose_rhs); zero rows past the active blocks."""
  if lhs.dtype == jnp.float32:
    from sparsejax.kernels.gmm import triton
    return triton.gmm(lhs, rhs, topo, transpose_rhs, out_dtype)
  configs = configs or DEFAULT_CONFIGS
  k = lhs.shape[1]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  cfg = _fit(configs.gmm_t if transpose_rhs else configs.gmm, k, n)
  lhs_p = _pad_to(lhs, 1, cfg.tile_k)
  if transpose_rhs:
    rhs_p = _pad_to(_pad_to(rhs, 1, 2 * cfg.tile_n), 2, cfg.tile_k)
  else:
    rhs_p = _pad_to(_pad_to(rhs, 1, cfg.tile_k), 2, 2 * cfg.tile_n)
  out = _gmm_padded(lhs_p, rhs_p, topo.row_block_expert, topo.num_active_blocks,
                    block_m=topo.block_size, transpose_rhs=transpose_rhs,
                    out_dtype=jnp.dtype(out_dtype), cfg=cfg)
  return out if out.shape[1] == n else out[:, :n]


# ----------------------------------------------------------------------------------------------
# tgmm: out[e] = sum over row blocks r of expert e of lhs[r]^T @ dout[r]
# ----------------------------------------------------------------------------------------------
def _tgmm_padded(lhs, dout, offsets, *, block_m, out_dtype, cfg: Config):
  rows, k = lhs.shape
  n = dout.shape[1]
  num_experts = offsets.shape[0] - 1
  # Output tiles are [tile_m of K] x [2 * tile_n of N]; the reduction runs over rows, tile_k at a
  # time (tile_k divides the 128-row block, so a step never leaves the expert).
  tile_m, tile_n, tile_r, epi_tile_n = block_m, cfg.tile_n, cfg.tile_k, cfg.epi_tile_n
  cta_n = 2 * tile_n
  m_iters, n_iters = k // tile_m, n // cta_n
  steps_per_block = block_m // tile_r
  dtype = lhs.dtype
  a_spec = plgpu.BlockSpec((tile_r, tile_m), lambda s: (s, 0), transforms=_transforms(tile_m, dtype))
  b_spec = plgpu.BlockSpec((tile_r, cta_n), lambda s: (s, 0), transforms=_transforms(cta_n, dtype))
  out_transforms = _transforms(epi_tile_n, out_dtype)

  def body(offsets_gmem, lhs_gmem, dout_gmem, out_gmem):
    ignore = lambda *_, **__: None
    allocs = _warp_specialized(ignore, (cfg.max_concurrent_steps,), [a_spec, b_spec], cfg,
                               ignore).get_allocations(
        lhs_gmem.at[:, pl.ds(0, tile_m)], dout_gmem.at[:, pl.ds(0, cta_n)])

    @functools.partial(
        pl.run_scoped, pipeline_allocs=allocs,
        out_smem=plgpu.SMEM((2, 2, tile_m, epi_tile_n), out_dtype, transforms=out_transforms),
        collective_axes="wg")
    def _scope(pipeline_allocs, out_smem):
      wg_idx = lax.axis_index("wg")

      # Experts major: the CTAs in flight work on one expert's rows, which stay in L2.
      @plgpu.nd_loop((num_experts, m_iters * n_iters), collective_axes="sm")
      def _tile(info):
        e = info.index[0]
        m_idx, n_idx = plgpu.planar_snake(
            info.index[1], (m_iters, n_iters), cfg.grid_minor_dim, cfg.grid_tile_width)
        first, last = offsets_gmem[e], offsets_gmem[e + 1]
        steps = (last - first) * steps_per_block  # zero for an expert with no rows
        row0 = first * steps_per_block
        m_slice = pl.ds(m_idx * tile_m, tile_m)
        n_slice = pl.ds(n_idx * cta_n, cta_n)
        wg_n = pl.ds(wg_idx * tile_n, tile_n)

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def _acc(acc_ref):
            eval_pipeline(acc_ref)
            _store_tile(acc_ref[...].astype(out_dtype), out_smem,
                        out_gmem.at[e, m_slice, n_slice], wg_idx, tile_m, tile_n, epi_tile_n)

        def mma(_, a_smem, b_smem, acc_ref):
          plgpu.wgmma(acc_ref, plgpu.transpose_ref(a_smem, (1, 0)), b_smem.at[:, wg_n])
          plgpu.wgmma_wait(0)
          return acc_ref

        a_specs = [
            plgpu.BlockSpec((tile_r, tile_m), lambda s: (row0 + s, 0), transforms=a_spec.transforms),
            plgpu.BlockSpec((tile_r, cta_n), lambda s: (row0 + s, 0), transforms=b_spec.transforms),
        ]
        _warp_specialized(mma, (steps,), a_specs, cfg, compute_context)(
            lhs_gmem.at[:, m_slice], dout_gmem.at[:, n_slice], allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return _launch(body, jax.ShapeDtypeStruct((num_experts, k, n), out_dtype), offsets, lhs, dout)


def tgmm(
    lhs: Float[Array, "rows k"],
    dout: Float[Array, "rows n"],
    topo: Topology,
    out_dtype,
    configs: Configs | None = None,
) -> Float[Array, "experts k n"]:
  """out[e] = lhs[rows of e]^T @ dout[rows of e]: the weight gradient (MegaBlocks' DS^T D)."""
  if lhs.dtype == jnp.float32:
    from sparsejax.kernels.gmm import triton
    return triton.tgmm(lhs, dout, topo, out_dtype)
  configs = configs or DEFAULT_CONFIGS
  k, n = lhs.shape[1], dout.shape[1]
  cfg = _fit(configs.tgmm, topo.block_size, n)
  lhs_p, dout_p = _pad_to(lhs, 1, topo.block_size), _pad_to(dout, 1, 2 * cfg.tile_n)
  out = _tgmm_padded(lhs_p, dout_p, topo.expert_block_offsets, block_m=topo.block_size,
                     out_dtype=jnp.dtype(out_dtype), cfg=cfg)
  return out if out.shape[1:] == (k, n) else out[:, :k, :n]
