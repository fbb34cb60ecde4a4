"""gmm_act and gmm_dact with an epilogue warpgroup, in Pallas Mosaic GPU (Hopper, sm_90).

mosaic.py's kernels end every output tile with an epilogue that both consumer warpgroups run at
once, so the tensor cores idle while the activation (or its derivative) is applied and the tile is
stored. At K = d_model (512 for MoE-XS) a tile has 8 K steps to amortize that over, and Nsight
Compute showed gmm_act and gmm_dact at 40% of the tensor pipe against 77% for a plain product
(experiments/notes_hopper_kernels.md). Here a fourth warpgroup owns the epilogue. The consumers
round their [64, tile_n] accumulator to bf16 into a staging buffer in shared memory, which costs
them what a plain product's store does, and start the next tile's wgmmas. The epilogue
warpgroup then stores the staged tile (x W_in: it is pre), and computes and stores act(pre), or
for dY W_out^T, dh * act'(pre) with pre's tile loaded by TMA while the consumers compute.

    kernel      staged      pre (TMA in)   writes
    gmm_act     pre         -              pre, act(pre)
    gmm_dact    dh          pre            dh * act'(pre)

Numerics: the activation and its derivative are taken of the bf16-rounded product, as the unfused
path computes them (op.gmm writes bf16, then XLA applies the activation) and as the backward
already evaluates act'(pre) at the stored bf16 pre; mosaic.py's epilogues use the float32
accumulator.

Pipeline, written out by hand: one producer warpgroup streams the A and B tiles of every step of
the CTA's tiles through one ring of max_concurrent_steps slots; both consumers read every slot
(64 rows each) and release it on the slot's "consumed" barrier. The staging buffers (n_buf of
them, used in turn by the tiles with rows) hand tiles to the epilogue warpgroup on "stage_full"
and back on "stage_free". Same contract as mosaic.py's gmm_act / gmm_dact (op.py): zero on the
rows of active blocks that hold no token, inactive blocks unwritten. Reference: reference.py;
custom_vjp: mlp.py. Chosen by Config(epilogue_wg=True) for the gmm_act / gmm_dact kinds.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sparsejax.activations import DERIVATIVES, PLAIN
from sparsejax.kernels.gmm import mosaic

# Four warpgroups share an SM's 64 K registers, 512 a thread on average: the producer needs few,
# the epilogue warpgroup holds [64, epi_tile_n] pieces, each consumer a [64, tile_n] accumulator.
PRODUCER_REGISTERS = 40
EPILOGUE_REGISTERS = 120
CONSUMER_REGISTERS = 176

_C = mosaic.Config
# The configs that select these kernels, as overrides of mosaic.Configs' fields (not the default
# until measured: experiments/bench_expert_mlp_parts.py --configs default,epilogue_wg).
CONFIGS = dict(
    gmm_act=_C(epilogue_wg=True, tile_n=128, max_concurrent_steps=4, epi_tile_n=64, grid_tile_width=8),
    gmm_dact=_C(epilogue_wg=True, tile_n=128, max_concurrent_steps=3, epi_tile_n=64, grid_tile_width=8))


def fit(cfg: mosaic.Config, k: int, n: int, block_m: int, num_pre: int) -> tuple[mosaic.Config, int]:
  """(cfg with tiles that fit shared memory, n_buf): the ring, n_buf staging buffers of
  [block_m, tile_n], gmm_dact's pre tile and the epilogue's store slots. Two staging buffers let
  the consumers run a whole tile ahead of the epilogue, but not at the price of a ring under 3
  deep; then one buffer, a 2-deep ring and narrower N tiles are the fallbacks, in that order."""
  tile_k = min(cfg.tile_k, max(64, pl.next_power_of_2(k)))
  tile_n = min(cfg.tile_n, max(64, pl.next_power_of_2(n)))
  while tile_n >= 64:
    epi = min(cfg.epi_tile_n, tile_n)
    stage_bytes = (block_m + tile_n) * tile_k * 2  # bf16 operands only (float32 goes to Triton)
    for min_slots in (3, 2):
      for n_buf in (2, 1):
        for slots in range(cfg.max_concurrent_steps, min_slots - 1, -1):
          smem = (slots * stage_bytes + (n_buf + num_pre) * block_m * tile_n * 2
                  + cfg.epi_slots * (block_m // 2) * epi * 2 + 2048)
          if smem <= mosaic._SMEM_BYTES:
            return dataclasses.replace(cfg, tile_k=tile_k, tile_n=tile_n, epi_tile_n=epi,
                                       max_concurrent_steps=slots), n_buf
    tile_n //= 2
  raise ValueError(f"no tiles of {cfg} fit the {mosaic._SMEM_BYTES} bytes of shared memory")


def gmm_padded(lhs, weights, row_block_expert, row_block_rows, pre=(), *, block_m, transpose_rhs,
               out_dtype, cfg: mosaic.Config, n_buf: int, activation):
  """gmm_act (pre=()) or gmm_dact (pre=(p,)) on padded operands, with mosaic._gmm_padded's
  signature (weights: one weight); see the module docstring."""
  (w,) = weights
  rows, k = lhs.shape
  n = w.shape[1] if transpose_rhs else w.shape[2]
  tile_n, tile_k, epi_n, epi_slots = cfg.tile_n, cfg.tile_k, cfg.epi_tile_n, cfg.epi_slots
  slots = cfg.max_concurrent_steps
  half = block_m // 2  # rows of a consumer: one wgmma M of 64
  m_iters, n_iters, k_iters = rows // block_m, n // tile_n, k // tile_k
  num_pre = len(pre)
  dtype = lhs.dtype
  if jnp.dtype(dtype).itemsize != 2 or jnp.dtype(out_dtype) != dtype or num_pre > 1:
    raise ValueError(f"the epilogue-warpgroup kernels take bf16 operands, write their dtype and read "
                     f"at most one pre; got {dtype} in, {jnp.dtype(out_dtype).name} out, {num_pre} pre")
  b_shape = (tile_n, tile_k) if transpose_rhs else (tile_k, tile_n)
  fn = PLAIN.get(activation, activation)
  # PLAIN's activations map the staged zero rows to zero; any other one is masked.
  mask_act = activation not in PLAIN

  def body(rbe_gmem, rbr_gmem, lhs_gmem, w_gmem, *refs):
    pre_gmems, out_gmems = refs[:num_pre], refs[num_pre:]
    scratch = dict(
        a_smem=plgpu.SMEM((slots, block_m, tile_k), dtype, transforms=mosaic._transforms(tile_k, dtype)),
        b_smem=plgpu.SMEM((slots, *b_shape), dtype, transforms=mosaic._transforms(b_shape[1], dtype)),
        full=plgpu.Barrier(num_arrivals=2, num_barriers=slots),  # the A and B copies of a slot
        consumed=plgpu.Barrier(num_arrivals=2, num_barriers=slots),  # both consumers
        # Indexed by (buffer, consumer): dynamic indices only ahead of the tiled dimensions.
        stage=plgpu.SMEM((n_buf, 2, half, tile_n), dtype, transforms=mosaic._transforms(epi_n, dtype)),
        stage_full=plgpu.Barrier(num_arrivals=2, num_barriers=n_buf),
        stage_free=plgpu.Barrier(num_arrivals=1, num_barriers=n_buf),
        out_smem=plgpu.SMEM((epi_slots, half, epi_n), dtype, transforms=mosaic._transforms(epi_n, dtype)))
    if num_pre:
      scratch.update(
          # One buffer: the epilogue loads tile e's pre once it has finished tile e - 1.
          pre_smem=plgpu.SMEM((2, half, tile_n), pre[0].dtype, transforms=mosaic._transforms(epi_n, pre[0].dtype)),
          pre_ready=plgpu.Barrier(num_arrivals=2))  # one copy a half

    @functools.partial(pl.run_scoped, collective_axes="wg", **scratch)
    def _scope(a_smem, b_smem, full, consumed, stage, stage_full, stage_free, out_smem,
               pre_smem=None, pre_ready=None):
      wg_idx = lax.axis_index("wg")

      def tile(lin):
        m_idx, n_idx = mosaic._tile_coords(lin, (m_iters, n_iters), cfg)
        num_real = rbr_gmem[m_idx]
        # Inactive blocks run zero steps, stage nothing and store nothing.
        return m_idx, n_idx, num_real, jnp.where(num_real > 0, k_iters, 0)

      grid = (m_iters * n_iters,)

      @pl.when(wg_idx == 2)
      def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        @plgpu.nd_loop(grid, collective_axes="sm", init_carry=(jnp.int32(0),))
        def issued(info, carry):
          (step0,) = carry
          m_idx, n_idx, _, steps = tile(info.index[0])
          mosaic.issue_gmm_tile(lhs_gmem, (w_gmem.at[rbe_gmem[m_idx]],), a_smem, (b_smem,), consumed,
                                lambda slot: full.at[slot], m_idx=m_idx, n_idx=n_idx, step0=step0,
                                steps=steps, block_m=block_m, tile_n=tile_n, tile_k=tile_k,
                                transpose_rhs=transpose_rhs)
          return (step0 + steps,)

        mosaic.observe_last_releases(lambda step: consumed.at[lax.rem(step, slots)], issued[0], slots)

      @pl.when(wg_idx < 2)
      def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        a_rows = pl.ds(wg_idx * half, half)

        @plgpu.nd_loop(grid, collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0)))
        def done(info, carry):
          step0, used = carry  # ring steps so far, staged tiles so far
          _, _, num_real, steps = tile(info.index[0])
          mine = num_real - wg_idx * half  # this consumer's rows that hold a token (may be <= 0)
          buf = lax.rem(used, n_buf)

          @pl.when(steps > 0)
          def _tile():
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((half, tile_n), jnp.float32))
            def _acc(acc_ref):
              def k_step(s, acc):
                slot = lax.rem(step0 + s, slots)
                plgpu.barrier_wait(full.at[slot])
                b = b_smem.at[slot]

                # Rows without a token need no wgmma: the zero accumulator is their answer.
                @pl.when(mine > 0)
                def _():
                  plgpu.wgmma(acc, a_smem.at[slot].at[a_rows],
                              b.transpose((1, 0)) if transpose_rhs else b)

                plgpu.wgmma_wait(1)  # the previous step's wgmma is done: release its slot

                @pl.when(s > 0)
                def _():
                  plgpu.barrier_arrive(consumed.at[lax.rem(step0 + s - 1, slots)])
                return acc

              acc = lax.fori_loop(0, steps, k_step, acc_ref)
              plgpu.wgmma_wait(0)
              plgpu.barrier_arrive(consumed.at[lax.rem(step0 + steps - 1, slots)])
              real = mosaic._row_iota((half, tile_n)) < mine
              value = jnp.where(real, acc[...], 0.0)

              @pl.when(used >= n_buf)  # the epilogue is done with this buffer's previous tile
              def _():
                plgpu.barrier_wait(stage_free.at[buf])

              for j in range(tile_n // epi_n):
                stage[buf, wg_idx, :, pl.ds(j * epi_n, epi_n)] = value[:, j * epi_n:(j + 1) * epi_n].astype(dtype)
              plgpu.commit_smem()  # the TMA store of the epilogue reads what these stores wrote
              plgpu.barrier_arrive(stage_full.at[buf])

          return step0 + steps, used + (steps > 0).astype(jnp.int32)

        used = done[1]

        @pl.loop(jnp.maximum(used - n_buf, 0), used)
        def _drain(e):
          plgpu.barrier_wait(stage_free.at[lax.rem(e, n_buf)])

      @pl.when(wg_idx == 3)
      def _epilogue():
        plgpu.set_max_registers(EPILOGUE_REGISTERS, action="decrease")

        @plgpu.nd_loop(grid, collective_axes="sm", init_carry=(jnp.int32(0),))
        def _done(info, carry):
          (used,) = carry
          m_idx, n_idx, num_real, steps = tile(info.index[0])
          buf = lax.rem(used, n_buf)
          cols = pl.ds(n_idx * tile_n, tile_n)

          @pl.when(steps > 0)
          def _tile():
            if num_pre:
              plgpu.commit_smem()  # the last tile's loads of pre_smem into registers precede the TMA write
              for hf in range(2):
                plgpu.copy_gmem_to_smem(pre_gmems[0].at[pl.ds(m_idx * block_m + hf * half, half), cols],
                                        pre_smem.at[hf], pre_ready)
            plgpu.barrier_wait(stage_full.at[buf])
            if num_pre:
              plgpu.barrier_wait(pre_ready)
              act_out = out_gmems[0]
            else:
              for hf in range(2):  # the staged product is pre itself
                plgpu.copy_smem_to_gmem(stage.at[buf, hf], out_gmems[0].at[pl.ds(m_idx * block_m + hf * half, half), cols])
              act_out = out_gmems[1]
            slot = 0
            for hf in range(2):
              real = mosaic._row_iota((half, epi_n)) < num_real - hf * half
              for j in range(tile_n // epi_n):
                pcols = pl.ds(j * epi_n, epi_n)
                x = mosaic._load_wgmma(stage.at[buf, hf, :, pcols]).astype(jnp.float32)
                if num_pre:
                  p = mosaic._load_wgmma(pre_smem.at[hf, :, pcols]).astype(jnp.float32)
                  # Selected: pre's rows past the tokens are whatever the caller passed.
                  y = jnp.where(real, x * DERIVATIVES[activation](p), 0.0)
                else:
                  y = jnp.where(real, fn(x), 0.0) if mask_act else fn(x)
                plgpu.wait_smem_to_gmem(epi_slots - 1, wait_read_only=True)
                out_smem[slot] = y.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out_smem.at[slot],
                    act_out.at[pl.ds(m_idx * block_m + hf * half, half),
                               pl.ds(n_idx * tile_n + j * epi_n, epi_n)])
                slot = (slot + 1) % epi_slots
            # Every store of this tile has read its shared memory, the staged pre's included.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(stage_free.at[buf])

          return (used + (steps > 0).astype(jnp.int32),)

        plgpu.wait_smem_to_gmem(0)

  out_shape = jax.ShapeDtypeStruct((rows, n), dtype)
  outs = out_shape if num_pre else (out_shape, out_shape)
  return mosaic._launch(body, outs, row_block_expert, row_block_rows, lhs, w, *pre, num_threads=4,
                        name=mosaic.gmm_kind(weights, pre, activation, transpose_rhs) + "_epilogue_wg")
