"""The ping-pong schedule of the Hopper gmm kernels (gmm, gmm_act, gmm_dact), in Pallas Mosaic GPU.

mosaic.py's kernels split each 128 x tile_n output tile between the two consumer warpgroups
(64 rows each), so both reach the epilogue together and the tensor cores idle while they apply
the activation and store. At K = d_model (512 for MoE-XS) a tile has only 8 K steps to hide that
behind, and gmm_act / gmm_dact ran at half a plain product's TFLOP/s. Here each consumer owns
whole tiles (a [128, tile_n] float32 accumulator) and the two take a CTA's active tiles in turn:
while one runs its epilogue, the other's wgmmas run (CUTLASS's "ping-pong" kernel schedule).

The pipeline is written out by hand because Pallas' emit_pipeline_warp_specialized hands every
step to both consumers. One producer warpgroup streams the A and B tiles of every step of the
CTA's tiles, in tile order, through one ring of max_concurrent_steps slots. A step's "full"
barrier belongs to the consumer that will read it (2 x slots barriers), so each consumer waits on
its own barriers only and their phases stay in step with it; the "consumed" barriers are waited
on by the producer alone, whichever consumer arrived. The ring runs across tile boundaries: the
next tile's loads start while this one's last steps compute.

Same contract as mosaic.py's gmm (op.py): zero on rows of active blocks that hold no token,
inactive blocks unwritten. Reference: reference.py; custom_vjp: op.py and mlp.py.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sparsejax.kernels.gmm import mosaic

PRODUCER_REGISTERS = 40
# (65536 - 128 * 40) / 256 threads of the two consumers, rounded down to a multiple of 8.
CONSUMER_REGISTERS = 232

_C = mosaic.Config
# The candidate configs of each schedule for the four one-weight gmm kinds, as overrides of
# mosaic.Configs (experiments/bench_expert_mlp_parts.py --schedules times them against the
# cooperative defaults; tests run each). "pingpong": 128 x 128 tiles, a [128, 128] float32
# accumulator a consumer (128 registers a thread); "pingpong64": half-block tiles, 64 x 256, which
# skip the padding half of an expert's last block outright; "staggered": mosaic.py's tiles.
SCHEDULES = {
    "pingpong": dict(
        gmm=_C(schedule="pingpong", tile_n=128, max_concurrent_steps=5, grid_tile_width=8),
        gmm_t=_C(schedule="pingpong", tile_n=128, max_concurrent_steps=5, grid_tile_width=8),
        gmm_act=_C(schedule="pingpong", tile_n=128, max_concurrent_steps=5, grid_tile_width=8),
        gmm_dact=_C(schedule="pingpong", tile_n=128, max_concurrent_steps=3, grid_tile_width=8)),
    "pingpong64": dict(
        gmm=_C(schedule="pingpong", tile_m=64, tile_n=256, max_concurrent_steps=4, grid_tile_width=8),
        gmm_t=_C(schedule="pingpong", tile_m=64, tile_n=256, max_concurrent_steps=4, grid_tile_width=8),
        gmm_act=_C(schedule="pingpong", tile_m=64, tile_n=256, max_concurrent_steps=4, grid_tile_width=8),
        gmm_dact=_C(schedule="pingpong", tile_m=64, tile_n=256, max_concurrent_steps=3, grid_tile_width=8)),
    "staggered": dict(
        gmm=_C(schedule="staggered", tile_n=256, max_concurrent_steps=4, grid_tile_width=8),
        gmm_t=_C(schedule="staggered", tile_n=256, max_concurrent_steps=4, grid_tile_width=8),
        gmm_act=_C(schedule="staggered", tile_n=128, max_concurrent_steps=6, grid_tile_width=8, stagger=3),
        gmm_dact=_C(schedule="staggered", tile_n=128, max_concurrent_steps=5, grid_tile_width=8, stagger=3)),
}


def fit(cfg: mosaic.Config, lhs, n: int, block_m: int, out_dtype, num_pre: int, pre_dtype):
  """cfg shrunk until one ring of [tile_m + tile_n, tile_k] stages, each consumer's epilogue
  slots of [tile_m, epi_tile_n] and its [tile_m, tile_n] tiles of pre fit shared memory."""
  if cfg.schedule not in ("pingpong", "staggered"):
    raise ValueError(f"schedule must be pingpong or staggered here; got {cfg.schedule!r}")
  if cfg.schedule == "pingpong" and (cfg.tile_m not in (64, 128) or block_m % cfg.tile_m):
    raise ValueError(f"tile_m must be 64 or 128 and divide the {block_m}-row block; got {cfg.tile_m}")
  size, out_size = jnp.dtype(lhs.dtype).itemsize, jnp.dtype(out_dtype).itemsize
  pre_size = jnp.dtype(pre_dtype).itemsize if num_pre else 0
  tm = block_m if cfg.schedule == "staggered" else cfg.tile_m
  cm = tm // 2 if cfg.schedule == "staggered" else tm  # rows of one consumer's accumulator
  return mosaic._fit(
      cfg, lhs.shape[1], n,
      stage_bytes=lambda c: (tm + c.tile_n) * c.tile_k * size,
      out_bytes=lambda c: 2 * (c.epi_slots * cm * c.epi_tile_n * out_size
                               + num_pre * cm * c.tile_n * pre_size))


def gmm_padded(lhs, w, row_block_expert, row_block_rows, pre=(), *, block_m, transpose_rhs,
               out_dtype, cfg: mosaic.Config, activation=None):
  """mosaic._gmm_padded's one-weight variants on the ping-pong schedule:

    pre      writes
    ()       acc                 (activation None)
    ()       acc, act(acc)       x W_in
    (p,)     acc * act'(p)       dY W_out^T
  """
  rows, k = lhs.shape
  n = w.shape[1] if transpose_rhs else w.shape[2]
  staggered = cfg.schedule == "staggered"
  tile_m = block_m if staggered else cfg.tile_m
  tile_n, tile_k, epi_tile_n = cfg.tile_n, cfg.tile_k, cfg.epi_tile_n
  slots = cfg.max_concurrent_steps
  per_block = block_m // tile_m  # row tiles of one block (of one expert)
  # Rows of a consumer's accumulator: staggered consumers split each tile's rows (as mosaic.py's),
  # ping-pong consumers own whole tiles.
  cm = tile_m // 2 if staggered else tile_m
  lag = min(cfg.stagger, slots) if staggered else 0
  m_iters, n_iters, k_iters = rows // tile_m, n // tile_n, k // tile_k
  num_pre = len(pre)
  if num_pre > 1:
    raise NotImplementedError("the ping-pong schedule has no GLU variant (two [128, tile_n] "
                              "accumulators per consumer would not fit its registers)")
  num_out = 1 if num_pre else 2 if activation is not None else 1
  dtype = lhs.dtype
  b_shape = (tile_n, tile_k) if transpose_rhs else (tile_k, tile_n)
  math = mosaic._epilogue_math(activation, num_pre)

  def body(rbe_gmem, rbr_gmem, lhs_gmem, w_gmem, *refs):
    pre_gmems, out_gmems = refs[:num_pre], refs[num_pre:]
    scratch = dict(
        a_smem=plgpu.SMEM((slots, tile_m, tile_k), dtype, transforms=mosaic._transforms(tile_k, dtype)),
        b_smem=plgpu.SMEM((slots, *b_shape), dtype, transforms=mosaic._transforms(b_shape[1], dtype)),
        full=plgpu.Barrier(num_arrivals=2, num_barriers=slots if staggered else 2 * slots),
        consumed=plgpu.Barrier(num_arrivals=2 if staggered else 1, num_barriers=slots),
        go=plgpu.Barrier(num_arrivals=1),
        out_smem=plgpu.SMEM((2, cfg.epi_slots, cm, epi_tile_n), out_dtype,
                            transforms=mosaic._transforms(epi_tile_n, out_dtype)))
    if num_pre:
      scratch.update(
          pre_smem=plgpu.SMEM((2, num_pre, cm, tile_n), pre[0].dtype,
                              transforms=mosaic._transforms(epi_tile_n, pre[0].dtype)),
          pre_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2 * num_pre))

    @functools.partial(pl.run_scoped, collective_axes="wg", **scratch)
    def _scope(a_smem, b_smem, full, consumed, go, out_smem, pre_smem=None, pre_ready=None):
      wg_idx = lax.axis_index("wg")

      def tile(lin):
        m_idx, n_idx = mosaic._tile_coords(lin, (m_iters, n_iters), cfg)
        block = m_idx // per_block
        # Real rows of this row tile; with 64-row tiles an expert's last block often fills only
        # its first half, and the second is skipped outright.
        block_rows = rbr_gmem[block]
        num_real = jnp.clip(block_rows - (m_idx % per_block) * tile_m, 0, tile_m)
        # Tiles of inactive blocks store nothing and are nobody's turn. A tile of an active
        # block without real rows runs zero steps and stores its zeros (op.py's contract).
        steps = jnp.where(num_real > 0, k_iters, 0)
        return m_idx, n_idx, block, num_real, steps, block_rows > 0

      # Both loops carry (ring steps issued so far, active tiles so far): the consumer of a tile
      # is the parity of the active tiles before it, and every thread derives it alike.
      start = (jnp.int32(0), jnp.int32(0))

      def producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm", init_carry=start)
        def issued(info, carry):
          step0, active = carry
          m_idx, n_idx, block, _, steps, active_tile = tile(info.index[0])
          first = 0 if staggered else lax.rem(active, 2) * slots  # the reading consumer's barriers
          w_e = w_gmem.at[rbe_gmem[block]]
          rows_ = pl.ds(m_idx * tile_m, tile_m)
          cols = pl.ds(n_idx * tile_n, tile_n)

          @pl.loop(0, steps)
          def _step(s):
            slot = lax.rem(step0 + s, slots)

            @pl.when(step0 + s >= slots)
            def _():
              plgpu.barrier_wait(consumed.at[slot])

            ks = pl.ds(s * tile_k, tile_k)
            plgpu.copy_gmem_to_smem(lhs_gmem.at[rows_, ks], a_smem.at[slot], full.at[first + slot])
            plgpu.copy_gmem_to_smem(w_e.at[cols, ks] if transpose_rhs else w_e.at[ks, cols],
                                    b_smem.at[slot], full.at[first + slot])

          return step0 + steps, active + active_tile.astype(jnp.int32)

        # Observe the last releases, so no barrier ends the kernel with an unobserved phase.
        total = issued[0]

        @pl.loop(jnp.maximum(total - slots, 0), total)
        def _drain(step):
          plgpu.barrier_wait(consumed.at[lax.rem(step, slots)])

      def consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")

        full_at = (lambda slot: full.at[slot]) if staggered else (lambda slot: full.at[wg_idx * slots + slot])
        if lag:
          # The second consumer starts lag steps behind the first, and the lag persists: while one
          # runs its epilogue the other's wgmmas run (the ring lets them drift up to slots apart).
          @pl.when(wg_idx == 1)
          def _():
            plgpu.barrier_wait(go)

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm", init_carry=start)
        def done(info, carry):
          step0, active = carry
          m_idx, n_idx, block, num_real, steps, active_tile = tile(info.index[0])
          rows_ = pl.ds(m_idx * tile_m + (wg_idx * cm if staggered else 0), cm)
          cols = pl.ds(n_idx * tile_n, tile_n)
          if staggered:
            num_real = jnp.clip(num_real - wg_idx * cm, 0, cm)
          a_rows = pl.ds(wg_idx * cm, cm) if staggered else slice(None)

          @pl.when(active_tile & (staggered | (lax.rem(active, 2) == wg_idx)))
          def _mine():
            # A tile without real rows stores zeros whatever pre holds: it loads none.
            @pl.when((steps > 0) & (num_real > 0) & (num_pre > 0))
            def _():
              plgpu.commit_smem()  # this consumer's reads of its last pre tile precede the TMA write
              for i, p in enumerate(pre_gmems):
                plgpu.copy_gmem_to_smem(p.at[rows_, cols], pre_smem.at[wg_idx, i],
                                        pre_ready.at[wg_idx * num_pre + i])

            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cm, tile_n), jnp.float32))
            def _acc(acc_ref):
              def k_step(s, acc):
                slot = lax.rem(step0 + s, slots)
                plgpu.barrier_wait(full_at(slot))
                b = b_smem.at[slot]

                # A staggered consumer whose rows hold no token issues no wgmma (zero is right).
                @pl.when(num_real > 0)
                def _():
                  plgpu.wgmma(acc, a_smem.at[slot].at[a_rows],
                              plgpu.transpose_ref(b, (1, 0)) if transpose_rhs else b)

                plgpu.wgmma_wait(1)  # the previous step's wgmma is done: release its slot
                if lag:
                  @pl.when((wg_idx == 0) & (step0 + s == lag - 1))
                  def _():
                    plgpu.barrier_arrive(go)

                @pl.when(s > 0)
                def _():
                  plgpu.barrier_arrive(consumed.at[lax.rem(step0 + s - 1, slots)])
                return acc

              acc = lax.fori_loop(0, steps, k_step, acc_ref)
              plgpu.wgmma_wait(0)

              @pl.when(steps > 0)
              def _():
                plgpu.barrier_arrive(consumed.at[lax.rem(step0 + steps - 1, slots)])
              value = acc[...]
              @pl.when((steps > 0) & (num_real > 0) & (num_pre > 0))
              def _():
                for i in range(num_pre):
                  plgpu.barrier_wait(pre_ready.at[wg_idx * num_pre + i])

              def epilogue(pieces, j):
                piece_cols = slice(j * epi_tile_n, (j + 1) * epi_tile_n)
                pre_pieces = [mosaic._load_wgmma(pre_smem.at[wg_idx, i, :, piece_cols]).astype(jnp.float32)
                              for i in range(num_pre)]
                real = mosaic._row_iota((cm, epi_tile_n)) < num_real
                return tuple(jnp.where(real, o, 0.0) for o in math(pieces, pre_pieces))

              outs = [o.at[rows_, cols] for o in out_gmems]
              mosaic._store_tile((value,), out_smem, outs, wg_idx, epi_tile_n, epilogue)

          return step0 + steps, active + active_tile.astype(jnp.int32)

        if lag:
          @pl.when((wg_idx == 0) & (done[0] < lag))  # fewer steps than the lag: release the other
          def _():
            plgpu.barrier_arrive(go)
        plgpu.wait_smem_to_gmem(0)

      lax.cond(wg_idx == 2, producer, consumer)

  out_shape = jax.ShapeDtypeStruct((rows, n), out_dtype)
  return mosaic._launch(body, (out_shape,) * num_out if num_out > 1 else out_shape,
                        row_block_expert, row_block_rows, lhs, w, *pre)
