"""tgmm with a ping-pong schedule, in Pallas Mosaic GPU (Hopper, sm_90).

    out[e] = sum over the real rows r of expert e of lhs[r]^T dout[r]      (the weight gradient)

mosaic.py's tgmm splits each 128 x 256 CTA tile between its two consumer warpgroups, so both run
their epilogue (convert, shared-memory writes and TMA stores of a [128, 128] float32 accumulator)
at the same time and the tensor cores idle meanwhile. At ~256 rows an expert (4 reduction steps
of 64 rows) half of tgmm's time is that per-tile cost (experiments/notes_hopper_kernels.md).
cuBLAS runs this case with a "ping-pong" kernel, and so does this file: output tiles are
128 (of K) x tile_n (of N), each consumer owns whole tiles, and the two take turns, so one's
epilogue runs under the other's wgmmas.

Schedule. The CTA's j-th tile of its persistent loop (counting every tile, empty experts' too:
their zero gradient is stored like any other tile) belongs to consumer j % 2. One producer
warpgroup issues the tiles' steps in order, tile j's into ring j % 2, so the operands of tile
j + 1 arrive after tile j's and the consumers fall into alternation without a barrier between
them. Two rings, because Mosaic GPU tracks a barrier's phase per waiting thread: a consumer must
wait on every phase of every barrier it waits on, in order, and cannot skip the phases of the
other consumer's steps. Ring c holds only consumer c's steps, with its own `full` (the A and B
copies of a slot) and `consumed` (its consumer's release) barriers. The producer waits on a
slot's `consumed` before reusing it, and at the end on the last phases of both rings.

Same contract as mosaic._tgmm_padded, the same arguments and tile order (heaviest_first experts,
reversed waves, planar_snake): an expert with no rows gets a zero gradient, and the padding rows
of an expert's last 64-row step are zeroed in its B tile (mosaic._zero_rows_from) before the
wgmma. Chosen by Config(pingpong=True) for tgmm. Measured on an H100 (experiments/probe_tgmm_tiles.py,
results/tgmm_pingpong_probe_H100.log, medians of 3 interleaved rounds): on E64 top-1's random
routing (~256 +- 16 rows an expert, about half the experts with a 5th, partial step) both weight
gradients 10% faster than mosaic.py's tgmm (0.418 against 0.467 ms, 0.407 against 0.450); on
exactly 256 rows an expert 3% slower, on 1,024 14% slower (a 128-wide tile loads its A tile for
half the columns, a third more operand bytes per output). Not the default until the expert MLP
is measured with it (experiments/bench_expert_mlp_parts.py --configs default,pingpong).
Reference: reference.py; contract and custom_vjp: op.py.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from sparsejax.kernels.gmm import mosaic

# Registers: mosaic.PRODUCER_REGISTERS / CONSUMER_REGISTERS (one [128, tile_n] accumulator a consumer).
PRODUCER_REGISTERS, CONSUMER_REGISTERS = mosaic.PRODUCER_REGISTERS, mosaic.CONSUMER_REGISTERS

# A [128, 256] float32 accumulator would be 256 registers a thread, more than a warpgroup has.
MAX_TILE_N = 128


def fit(cfg: mosaic.Config, n: int, block_m: int, operand_dtype, out_dtype) -> mosaic.Config:
  """cfg with tiles that fit shared memory: two rings of max_concurrent_steps slots, each slot an
  A tile [tile_k, block_m] and a B tile [tile_k, tile_n], and each consumer's two epi_tile_n-wide
  store slots. The deepest ring first (down to 2 slots: with one, a consumer that keeps a wgmma in
  flight would hold the slot the producer waits for), with the widest store pieces that fit beside
  it (down to 16 columns); then, for a config given by hand, tile_k down to 64."""
  tile_n = min(cfg.tile_n, MAX_TILE_N, max(64, pl.next_power_of_2(n)))
  size, out_size = jnp.dtype(operand_dtype).itemsize, jnp.dtype(out_dtype).itemsize
  tile_k = min(cfg.tile_k, block_m)
  while tile_k >= 64:
    for slots in range(cfg.max_concurrent_steps, 1, -1):
      epi = min(cfg.epi_tile_n, tile_n)
      while epi >= 16:
        rings = 2 * slots * (block_m + tile_n) * tile_k * size
        stores = 2 * 2 * block_m * epi * out_size
        if rings + stores + 1024 <= mosaic._SMEM_BYTES:  # 1 KiB: the barriers and alignment
          return dataclasses.replace(cfg, tile_n=tile_n, tile_k=tile_k, epi_tile_n=epi,
                                     max_concurrent_steps=slots)
        epi //= 2
    tile_k //= 2
  raise ValueError(f"the ping-pong tgmm needs two rings of at least 2 slots and the stores in "
                   f"{mosaic._SMEM_BYTES} bytes of shared memory; no tiles of {cfg} fit")


def tgmm_padded(
    lhs: Float[Array, "rows k"],
    dout: Float[Array, "rows n"],
    order: Int[Array, "experts"],
    offsets: Int[Array, "experts_plus_one"],
    row_block_rows: Int[Array, "row_blocks"],
    *,
    block_m: int,
    out_dtype,
    cfg: mosaic.Config,
) -> Float[Array, "experts k n"]:
  """out[e] = lhs[real rows of e]^T @ dout[real rows of e] on operands padded to the tiles (k to
  block_m, n to cfg.tile_n), with mosaic._tgmm_padded's arguments; see the module docstring."""
  k, n = lhs.shape[1], dout.shape[1]
  num_experts = offsets.shape[0] - 1
  tile_m, tile_n, tile_r, epi_n = block_m, cfg.tile_n, cfg.tile_k, cfg.epi_tile_n
  slots = cfg.max_concurrent_steps
  m_iters, n_iters = k // tile_m, n // tile_n
  tiles = m_iters * n_iters
  total = num_experts * tiles
  num_sms = mosaic._num_sms()
  dtype = lhs.dtype

  def body(order_gmem, offsets_gmem, rbr_gmem, lhs_gmem, dout_gmem, out_gmem):
    scratch = dict(
        # Indexed (ring, slot): dynamic indices only ahead of the tiled dimensions.
        a_smem=plgpu.SMEM((2, slots, tile_r, tile_m), dtype, transforms=mosaic._transforms(tile_m, dtype)),
        b_smem=plgpu.SMEM((2, slots, tile_r, tile_n), dtype, transforms=mosaic._transforms(tile_n, dtype)),
        # Ring c's barriers are c * slots + slot: one array each, so that a ring is picked by index
        # (the producer's ring and a consumer's own are dynamic), but no barrier serves two rings.
        full=plgpu.Barrier(num_arrivals=2, num_barriers=2 * slots),  # the A and B copies
        consumed=plgpu.Barrier(num_arrivals=1, num_barriers=2 * slots),  # the ring's consumer
        # (consumer, store slot): mosaic._store_tile's layout.
        out_smem=plgpu.SMEM((2, 2, tile_m, epi_n), out_dtype,
                            transforms=mosaic._transforms(epi_n, out_dtype)))

    @functools.partial(pl.run_scoped, collective_axes="wg", **scratch)
    def _scope(a_smem, b_smem, full, consumed, out_smem):
      wg_idx = lax.axis_index("wg")

      tile = lambda step: mosaic._tgmm_tile(step, order_gmem, offsets_gmem, rbr_gmem,
                                            grid=(m_iters, n_iters), num_experts=num_experts,
                                            num_sms=num_sms, block_m=block_m, cfg=cfg)

      bar = lambda ring, step: ring * slots + lax.rem(step, slots)

      @pl.when(wg_idx == 2)
      def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        @plgpu.nd_loop((total,), collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0)))
        def issued(info, carry):
          ring = lax.rem(info.local_index, 2)  # the consumer that owns this tile
          _, m_idx, n_idx, steps, _, row0 = tile(info.index[0])
          step0 = jnp.where(ring == 0, carry[0], carry[1])  # steps issued to this ring so far
          cols_a, cols_b = pl.ds(m_idx * tile_m, tile_m), pl.ds(n_idx * tile_n, tile_n)

          @pl.loop(0, steps)
          def _step(s):
            slot, b = lax.rem(step0 + s, slots), bar(ring, step0 + s)

            @pl.when(step0 + s >= slots)
            def _():
              plgpu.barrier_wait(consumed.at[b])

            rows = pl.ds((row0 + s) * tile_r, tile_r)
            plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, cols_a], a_smem.at[ring, slot], full.at[b])
            plgpu.copy_gmem_to_smem(dout_gmem.at[rows, cols_b], b_smem.at[ring, slot], full.at[b])

          return (carry[0] + jnp.where(ring == 0, steps, 0), carry[1] + jnp.where(ring == 1, steps, 0))

        for ring in range(2):
          mosaic.observe_last_releases(functools.partial(lambda r, step: consumed.at[bar(r, step)], ring),
                                       issued[ring], slots)

      @pl.when(wg_idx < 2)
      def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        # The CTA's tiles are items sm, sm + num_sms, ... (nd_loop's order); this consumer takes
        # every second one from its own index on, so it loads no metadata of the other's tiles.
        sm = lax.axis_index("sm")
        local_tiles = (total - sm + num_sms - 1) // num_sms
        own_tiles = (local_tiles - wg_idx + 1) // 2

        def one_tile(i, step0):
          e, m_idx, n_idx, steps, tail, _ = tile((wg_idx + 2 * i) * num_sms + sm)

          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def _acc(acc_ref):
            def k_step(s, acc):
              slot, b_idx = lax.rem(step0 + s, slots), bar(wg_idx, step0 + s)
              plgpu.barrier_wait(full.at[b_idx])
              b = b_smem.at[wg_idx, slot]

              # The last step may reach into its block's padding rows: zero them in B.
              @pl.when((s == steps - 1) & (tail < tile_r))
              def _():
                mosaic._zero_rows_from(b, tail)

              plgpu.wgmma(acc, plgpu.transpose_ref(a_smem.at[wg_idx, slot], (1, 0)), b)
              plgpu.wgmma_wait(1)  # the previous step's wgmma is done: release its slot

              @pl.when(s > 0)
              def _():
                plgpu.barrier_arrive(consumed.at[bar(wg_idx, step0 + s - 1)])
              return acc

            acc = lax.fori_loop(0, steps, k_step, acc_ref)
            plgpu.wgmma_wait(0)

            @pl.when(steps > 0)
            def _():
              plgpu.barrier_arrive(consumed.at[bar(wg_idx, step0 + steps - 1)])

            # The stores overlap this consumer's next tile (and the other's wgmmas throughout).
            out = out_gmem.at[e, pl.ds(m_idx * tile_m, tile_m), pl.ds(n_idx * tile_n, tile_n)]
            mosaic._store_tile((acc[...],), out_smem, [out], wg_idx, epi_n)

          return step0 + steps

        lax.fori_loop(0, own_tiles, one_tile, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

  return mosaic._launch(body, jax.ShapeDtypeStruct((num_experts, k, n), out_dtype),
                        order, offsets, row_block_rows, lhs, dout)
