"""gmm and tgmm with a ping-pong schedule, in Pallas Mosaic GPU (Hopper, sm_90).

    tgmm:  out[e] = sum over the real rows r of expert e of lhs[r]^T dout[r]   (the weight gradient)
    gmm:   out[r] = epilogue(lhs[r] @ W[e(r)])                                  (and its variants)

mosaic.py's kernels split each CTA tile between their two consumer warpgroups, so both run their
epilogue (the activation or its derivative, convert, shared-memory writes and TMA stores) at the
same time and the tensor cores idle meanwhile. cuBLAS and CUTLASS run such cases with a "ping-pong"
kernel, and so does this file: each consumer owns whole output tiles and the two take turns, so
one's epilogue runs under the other's wgmmas.

Schedule. The CTA's j-th tile of its persistent loop (counting every tile: empty experts' in tgmm,
whose zero gradient is stored like any other tile; inactive row blocks' in gmm, which run zero
steps and store nothing) belongs to consumer j % 2. One producer warpgroup issues the tiles' steps
in order, so the operands of tile j + 1 arrive after tile j's and the consumers fall into
alternation. Mosaic GPU tracks a barrier's phase per waiting thread: a consumer must wait on every
phase of every barrier it waits on, in order, and cannot skip the phases of the other consumer's
steps. Both kernels meet that with one ring whose slots signal the `full` barrier of the step's
owner (gmm_padded's docstring); a ring per consumer, as tgmm_padded had before, halves the depth
in the same shared memory (one ring of 6 ran E64 top-1's weight gradients 19-22% faster than two
rings of 4 on an H100: results/tgmm_one_ring_ab_H100.log).
The producer waits on a slot's `consumed` before reusing it, and at the end on the last phases.

tgmm: output tiles are 128 (of K) x tile_n (of N). Same contract as mosaic._tgmm_padded, the same
arguments and tile order (heaviest_first experts, reversed waves, planar_snake): an expert with no
rows gets a zero gradient, and the padding rows of an expert's last 64-row step are zeroed in its
B tile (mosaic._zero_rows_from) before the wgmma. Chosen by Config(pingpong=True) for tgmm.
Measured on an H100 with a ring per consumer (experiments/probe_tgmm_tiles.py,
results/tgmm_pingpong_probe_H100.log, medians of 3 interleaved rounds): on E64 top-1's random
routing (~256 +- 16 rows an expert, about half the experts with a 5th, partial step) both weight
gradients 10% faster than mosaic.py's tgmm (0.418 against 0.467 ms, 0.407 against 0.450); on
exactly 256 rows an expert 3% slower, on 1,024 14% slower (a 128-wide tile loads its A tile for
half the columns, a third more operand bytes per output). With the one ring, 0.327 / 0.324 ms
on E64 top-1, and 5-10% faster than mosaic.py's tgmm on E64 top-8's kernels (an MLP tie).
Configs.tgmm_short picks it below SHORT_ROWS rows an expert.

gmm: output tiles are one 128-row block x tile_n (at most 128: a consumer holds a [128, tile_n]
float32 accumulator; 64 for the GLU forms' two), walked in mosaic._gmm_padded's order
(expert_band_order or planar_snake), with its epilogues (mosaic.gmm_epilogue: plain, act, dact,
glu, dglu). gmm_dact's and gmm_dglu's pre tiles arrive by TMA in shared memory, a tile a consumer
(read from global memory into registers instead, which gave gmm_dact a 6-slot ring, it ran 5%
slower skewed and tied balanced: results/dact_schedules_ab_H100.log). A block whose real rows fit
in its first 64 runs its wgmmas on those rows only. Same contract as mosaic._gmm_padded: zero on
the rows of active blocks that hold no token, inactive blocks unwritten. Chosen by
Config(pingpong=True) for a gmm kind: Configs.gmm_act and gmm_dact (below LONG_ROWS rows an
expert) and gmm_glu_short (below SHORT_ROWS); opt-in for the others (gmm_dglu on it: 2% faster
on E64 top-1, 20% slower on E64 top-8, on an H100: results/glu_fusion_pingpong_H100.log). Measured on an H200
(results/act_kernels_pingpong_H200.log; tune_act_kernels.py and bench_expert_mlp_parts.py
--ab-rounds 5) against the cooperative kernel's best configs: gmm_act 0.322 ms against 0.364
on E64 top-1 and 0.462 against 0.492 on E64 top-8, gmm_dact 0.349-0.368 against 0.389 and
0.502-0.525 against 0.520, the expert MLP fwd+bwd -3.3% and -1.8%. A ring per consumer, as
tgmm's, ran slower than the cooperative kernel on an H100: gmm_act 12-29% (rings of 3), gmm_dact
30-97% (rings of 2 beside its pre tiles). The ring's depth is what sharing it buys.
Reference: reference.py; contract and custom_vjp: op.py (mlp.py for the fused MLP).
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
  """cfg with tgmm tiles that fit shared memory: one ring of max_concurrent_steps slots, each an
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
        ring = slots * (block_m + tile_n) * tile_k * size
        stores = 2 * 2 * block_m * epi * out_size
        if ring + stores + 1024 <= mosaic._SMEM_BYTES:  # 1 KiB: the barriers and alignment
          return dataclasses.replace(cfg, tile_n=tile_n, tile_k=tile_k, epi_tile_n=epi,
                                     max_concurrent_steps=slots)
        epi //= 2
    tile_k //= 2
  raise ValueError(f"the ping-pong tgmm needs a ring of at least 2 slots and the stores in "
                   f"{mosaic._SMEM_BYTES} bytes of shared memory; no tiles of {cfg} fit")


def _produce(total, slots, full, consumed, issue):
  """The producer warpgroup of both kernels: the CTA's tiles in order, tile j's steps into the one
  ring with their copies signalling full[(j % 2) * slots + slot] (its owner's barrier);
  issue(j, ready, step0) loads tile j's steps as the ring's steps step0, ... and returns their
  count. Then it observes the ring's last releases."""
  plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

  @plgpu.nd_loop((total,), collective_axes="sm", init_carry=(jnp.int32(0),))
  def issued(info, carry):
    (step0,) = carry  # the CTA's steps so far
    owner = lax.rem(info.local_index, 2)
    return (step0 + issue(info.local_index, lambda slot: full.at[owner * slots + slot], step0),)

  mosaic.observe_last_releases(lambda step: consumed.at[lax.rem(step, slots)], issued[0], slots)


def tgmm_padded(
    lhs: Float[Array, "rows k"],
    dout: Float[Array, "rows n"],
    plan: Int[Array, "experts 4"],
    *,
    block_m: int,
    out_dtype,
    cfg: mosaic.Config,
) -> Float[Array, "experts k n"]:
  """out[e] = lhs[real rows of e]^T @ dout[real rows of e] on operands padded to the tiles (k to
  block_m, n to cfg.tile_n), with mosaic._tgmm_padded's arguments; see the module docstring. One
  ring for both consumers, full barriers per owner and turn barriers, as gmm_padded."""
  k, n = lhs.shape[1], dout.shape[1]
  num_experts = plan.shape[0]
  tile_m, tile_n, tile_r, epi_n = block_m, cfg.tile_n, cfg.tile_k, cfg.epi_tile_n
  slots = cfg.max_concurrent_steps
  m_iters, n_iters = k // tile_m, n // tile_n
  total = num_experts * m_iters * n_iters
  num_sms = mosaic._num_sms()
  dtype = lhs.dtype

  def body(plan_gmem, lhs_gmem, dout_gmem, out_gmem):
    scratch = dict(
        a_smem=plgpu.SMEM((slots, tile_r, tile_m), dtype, transforms=mosaic._transforms(tile_m, dtype)),
        b_smem=plgpu.SMEM((slots, tile_r, tile_n), dtype, transforms=mosaic._transforms(tile_n, dtype)),
        # full[c * slots + slot]: the A and B copies of a step of consumer c's into the slot.
        full=plgpu.Barrier(num_arrivals=2, num_barriers=2 * slots),
        consumed=plgpu.Barrier(num_arrivals=1, num_barriers=slots),  # the step's consumer
        turn=plgpu.Barrier(num_arrivals=1, num_barriers=2),  # as gmm_padded's
        # (consumer, store slot): mosaic._store_tile's layout.
        out_smem=plgpu.SMEM((2, 2, tile_m, epi_n), out_dtype,
                            transforms=mosaic._transforms(epi_n, out_dtype)))

    @functools.partial(pl.run_scoped, collective_axes="wg", **scratch)
    def _scope(a_smem, b_smem, full, consumed, turn, out_smem):
      wg_idx = lax.axis_index("wg")
      sm = lax.axis_index("sm")
      local_tiles = (total - sm + num_sms - 1) // num_sms  # the CTA's: sm, sm + num_sms, ...

      def tile(local):
        """(expert, row tile, column tile, steps, real rows of the last step, first step's row
        block x steps a block) of the CTA's local-th tile (zero steps past its last one)."""
        lin = jnp.clip(jnp.minimum(local, local_tiles - 1) * num_sms + sm, 0, total - 1)
        e, m_idx, n_idx, steps, tail, row0 = mosaic._tgmm_tile(lin, plan_gmem, grid=(m_iters, n_iters),
                                                               num_sms=num_sms, cfg=cfg)
        return e, m_idx, n_idx, jnp.where(local < local_tiles, steps, 0), tail, row0

      @pl.when(wg_idx == 2)
      def _producer():
        def issue(local, ready, step0):
          _, m_idx, n_idx, steps, _, row0 = tile(local)
          mosaic.issue_tgmm_tile(lhs_gmem, dout_gmem, a_smem, b_smem, consumed, ready, m_idx=m_idx,
                                 n_idx=n_idx, row0=row0, step0=step0, steps=steps, tile_r=tile_r,
                                 tile_m=tile_m, tile_n=tile_n)
          return steps

        _produce(total, slots, full, consumed, issue)

      @pl.when(wg_idx < 2)
      def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        own_tiles = (local_tiles - wg_idx + 1) // 2

        def one_tile(i, step0):  # step0: the CTA's steps before this tile
          local = wg_idx + 2 * i
          e, m_idx, n_idx, steps, tail, _ = tile(local)

          @pl.when(local > 0)
          def _():
            plgpu.barrier_wait(turn.at[wg_idx])

          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def _acc(acc_ref):
            def k_step(s, acc):
              slot = lax.rem(step0 + s, slots)
              plgpu.barrier_wait(full.at[wg_idx * slots + slot])
              b = b_smem.at[slot]

              # The last step may reach into its block's padding rows: zero them in B.
              @pl.when((s == steps - 1) & (tail < tile_r))
              def _():
                mosaic._zero_rows_from(b, tail)

              plgpu.wgmma(acc, a_smem.at[slot].transpose((1, 0)), b)
              plgpu.wgmma_wait(1)  # the previous step's wgmma is done: release its slot

              @pl.when(s > 0)
              def _():
                plgpu.barrier_arrive(consumed.at[lax.rem(step0 + s - 1, slots)])
              return acc

            acc = lax.fori_loop(0, steps, k_step, acc_ref)

            @pl.when(local + 1 < local_tiles)  # the other consumer's next tile may start its K loop
            def _():
              plgpu.barrier_arrive(turn.at[1 - wg_idx])

            plgpu.wgmma_wait(0)

            @pl.when(steps > 0)
            def _():
              plgpu.barrier_arrive(consumed.at[lax.rem(step0 + steps - 1, slots)])

            # An expert with no rows ran zero steps: its gradient is the zero accumulator, stored.
            # The stores overlap the other consumer's K loop (and this one's next).
            out = out_gmem.at[e, pl.ds(m_idx * tile_m, tile_m), pl.ds(n_idx * tile_n, tile_n)]
            mosaic._store_tile((acc[...],), out_smem, [out], wg_idx, epi_n)

          return step0 + steps + tile(local + 1)[3]  # and the other consumer's next tile

        lax.fori_loop(0, own_tiles, one_tile, jnp.where(wg_idx == 1, tile(0)[3], 0))
        plgpu.wait_smem_to_gmem(0)

  return mosaic._launch(body, jax.ShapeDtypeStruct((num_experts, k, n), out_dtype),
                        plan, lhs, dout, name="tgmm_pingpong")


def fit_gmm(cfg: mosaic.Config, k: int, n: int, block_m: int, num_pre: int, operand_dtype,
            out_dtype, num_w: int = 1) -> mosaic.Config:
  """cfg with gmm tiles that fit shared memory: the ring of max_concurrent_steps slots (each an A
  tile [block_m, tile_k] and num_w B tiles of [tile_k, tile_n]), each consumer's num_pre pre tiles
  [block_m, tile_n] and its epi_slots store slots of [block_m, epi_tile_n]. The widest tiles with
  a ring at least 3 deep, as deep as fits, with the widest store pieces beside it (down to 16
  columns); then narrower tiles (down to 64), then 2 slots, then tile_k down to 64 for a config
  given by hand. The GLU forms (num_w 2) hold two [block_m, tile_n] accumulators a consumer, so
  their tiles are at most half as wide."""
  size, out_size = jnp.dtype(operand_dtype).itemsize, jnp.dtype(out_dtype).itemsize
  widest = min(cfg.tile_n, MAX_TILE_N // num_w, max(64, pl.next_power_of_2(n)))
  tile_k = min(cfg.tile_k, max(64, pl.next_power_of_2(k)))
  while tile_k >= 64:
    for min_slots in (3, 2):
      tile_n = widest
      while tile_n >= 64:
        pre = 2 * num_pre * block_m * tile_n * size
        for slots in range(cfg.max_concurrent_steps, min_slots - 1, -1):
          epi = min(cfg.epi_tile_n, tile_n)
          while epi >= 16:
            ring = slots * (block_m + num_w * tile_n) * tile_k * size
            stores = 2 * cfg.epi_slots * block_m * epi * out_size
            if ring + pre + stores + 1024 <= mosaic._SMEM_BYTES:
              return dataclasses.replace(cfg, tile_n=tile_n, tile_k=tile_k, epi_tile_n=epi,
                                         max_concurrent_steps=slots)
            epi //= 2
        tile_n //= 2
    tile_k //= 2
  raise ValueError(f"the ping-pong gmm needs a ring of at least 2 slots, {num_pre} pre tiles "
                   f"and the stores in {mosaic._SMEM_BYTES} bytes of shared memory; no tiles of "
                   f"{cfg} fit")


def gmm_padded(
    lhs: Float[Array, "rows k"],
    weights: tuple[Float[Array, "experts k n"] | Float[Array, "experts n k"]],
    row_block_expert: Int[Array, "row_blocks"],
    row_block_rows: Int[Array, "row_blocks"],
    pre: tuple[Float[Array, "rows n"], ...] = (),
    *,
    block_m: int,
    transpose_rhs: bool,
    out_dtype,
    cfg: mosaic.Config,
    activation=None,
    order: Int[Array, "tiles"] | None = None,
) -> Float[Array, "rows n"] | tuple[Float[Array, "rows n"], ...]:
  """mosaic._gmm_padded's products and epilogues (plain, act, dact; and the GLU forms, two
  accumulators a consumer) on the ping-pong schedule, with its arguments; see the module docstring.

  Both consumers read one ring of max_concurrent_steps slots, as CUTLASS's ping-pong kernels do
  (twice tgmm_padded's depth in the same shared memory). A slot's fill signals the `full` barrier
  of the step's owner (full[c, slot]), so each consumer waits on every phase of its own barriers
  and on none of the other's: the per-thread phase tracking that makes tgmm_padded keep a ring
  per consumer is satisfied. Only the producer waits on `consumed`, every phase in order. The
  `turn` barriers make the K loops alternate strictly: a consumer starts a tile's loop once the
  other has issued its previous tile's wgmmas, and runs its epilogue under the other's loop.
  """
  rows, k = lhs.shape
  n = weights[0].shape[1] if transpose_rhs else weights[0].shape[2]
  num_w = len(weights)
  tile_n, tile_k, epi_n, slots = cfg.tile_n, cfg.tile_k, cfg.epi_tile_n, cfg.max_concurrent_steps
  half = block_m // 2  # one wgmma M: a block with at most this many real rows computes these only
  m_iters, n_iters, k_iters = rows // block_m, n // tile_n, k // tile_k
  total = m_iters * n_iters
  num_pre = len(pre)
  num_out = num_pre if num_pre else 3 if num_w == 2 else 2 if activation is not None else 1
  num_sms = mosaic._num_sms()
  dtype = lhs.dtype
  b_shape = (tile_n, tile_k) if transpose_rhs else (tile_k, tile_n)

  def body(*refs):
    order_gmem = refs[0] if order is not None else None
    rbe_gmem, rbr_gmem, lhs_gmem, *rest = refs[order is not None:]
    w_gmems, pre_gmems, out_gmems = rest[:num_w], rest[num_w:num_w + num_pre], rest[num_w + num_pre:]
    b_smem = lambda: plgpu.SMEM((slots, *b_shape), dtype, transforms=mosaic._transforms(b_shape[1], dtype))
    scratch = dict(
        a_smem=plgpu.SMEM((slots, block_m, tile_k), dtype, transforms=mosaic._transforms(tile_k, dtype)),
        b_smem=b_smem(),
        # full[c * slots + slot]: the A and B copies of a step of consumer c's into the slot.
        full=plgpu.Barrier(num_arrivals=1 + num_w, num_barriers=2 * slots),
        consumed=plgpu.Barrier(num_arrivals=1, num_barriers=slots),  # the step's consumer
        # turn[c]: consumer 1 - c has issued its tile's wgmmas; consumer c's next K loop may start.
        turn=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        # (consumer, store slot): mosaic._store_tile's layout.
        out_smem=plgpu.SMEM((2, cfg.epi_slots, block_m, epi_n), out_dtype,
                            transforms=mosaic._transforms(epi_n, out_dtype)))
    if num_w == 2:
      scratch.update(b2_smem=b_smem())  # W_in's, beside W_gate's
    if num_pre:
      # A consumer's pre tiles ((2, block_m, tile_n) for one, so the one-pre kernel keeps its layout).
      scratch.update(pre_smem=plgpu.SMEM((2, *((num_pre,) if num_pre > 1 else ()), block_m, tile_n),
                                         pre[0].dtype, transforms=mosaic._transforms(epi_n, pre[0].dtype)),
                     pre_ready=plgpu.Barrier(num_arrivals=num_pre, num_barriers=2))  # one a consumer

    @functools.partial(pl.run_scoped, collective_axes="wg", **scratch)
    def _scope(a_smem, b_smem, full, consumed, turn, out_smem, b2_smem=None, pre_smem=None,
               pre_ready=None):
      b_smems = (b_smem,) if num_w == 1 else (b_smem, b2_smem)
      # This consumer's i-th pre tile in pre_smem (one pre: no index of its own).
      pre_idx = lambda i: (wg_idx,) if num_pre == 1 else (wg_idx, i)
      wg_idx = lax.axis_index("wg")
      sm = lax.axis_index("sm")
      local_tiles = (total - sm + num_sms - 1) // num_sms  # the CTA's: sm, sm + num_sms, ...

      def tile(local):
        """(row block, column tile, real rows, K steps) of the CTA's local-th tile (zero steps
        past its last one)."""
        lin = jnp.clip(jnp.minimum(local, local_tiles - 1) * num_sms + sm, 0, total - 1)
        if order is None:
          m_idx, n_idx = mosaic._tile_coords(lin, (m_iters, n_iters), cfg)
        else:
          code = order_gmem[lin]
          m_idx, n_idx = lax.div(code, jnp.int32(n_iters)), lax.rem(code, jnp.int32(n_iters))
        num_real = rbr_gmem[m_idx]
        # Inactive blocks run zero steps and store nothing.
        return m_idx, n_idx, num_real, jnp.where((num_real > 0) & (local < local_tiles), k_iters, 0)

      @pl.when(wg_idx == 2)
      def _producer():
        def issue(local, ready, step0):
          m_idx, n_idx, _, steps = tile(local)
          mosaic.issue_gmm_tile(lhs_gmem, tuple(w.at[rbe_gmem[m_idx]] for w in w_gmems), a_smem,
                                b_smems, consumed, ready, m_idx=m_idx, n_idx=n_idx, step0=step0,
                                steps=steps, block_m=block_m, tile_n=tile_n, tile_k=tile_k,
                                transpose_rhs=transpose_rhs)
          return steps

        _produce(total, slots, full, consumed, issue)

      @pl.when(wg_idx < 2)
      def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        own_tiles = (local_tiles - wg_idx + 1) // 2
        first_half = pl.ds(0, half)

        def one_tile(i, step0):  # step0: the CTA's steps before this tile
          local = wg_idx + 2 * i
          m_idx, n_idx, num_real, steps = tile(local)
          rows_, cols = pl.ds(m_idx * block_m, block_m), pl.ds(n_idx * tile_n, tile_n)

          if num_pre:
            @pl.when(steps > 0)
            def _():
              plgpu.commit_smem()  # the last tile's reads of pre_smem come before this TMA write
              for i, p in enumerate(pre_gmems):
                plgpu.copy_gmem_to_smem(p.at[rows_, cols], pre_smem.at[pre_idx(i)], pre_ready.at[wg_idx])

          @pl.when(local > 0)
          def _():
            plgpu.barrier_wait(turn.at[wg_idx])

          @functools.partial(pl.run_scoped, **{f"acc{i}": plgpu.ACC((block_m, tile_n), jnp.float32)
                                               for i in range(num_w)})
          def _acc(**acc_refs):
            def k_step(s, accs):
              slot = lax.rem(step0 + s, slots)
              plgpu.barrier_wait(full.at[wg_idx * slots + slot])
              a = a_smem.at[slot]
              for acc, b_ring in zip(accs, b_smems, strict=True):
                b = b_ring.at[slot]
                b = b.transpose((1, 0)) if transpose_rhs else b

                # One commit group a weight and step either way, so the wait below keeps its meaning.
                @pl.when(num_real > half)
                def _():
                  plgpu.wgmma(acc, a, b)

                @pl.when(num_real <= half)
                def _():
                  plgpu.wgmma(acc.at[first_half], a.at[first_half], b)

              plgpu.wgmma_wait(num_w)  # the previous step's wgmmas are done: release its slot

              @pl.when(s > 0)
              def _():
                plgpu.barrier_arrive(consumed.at[lax.rem(step0 + s - 1, slots)])
              return accs

            accs = lax.fori_loop(0, steps, k_step, tuple(acc_refs[f"acc{i}"] for i in range(num_w)))

            @pl.when(local + 1 < local_tiles)  # the other consumer's next tile may start its K loop
            def _():
              plgpu.barrier_arrive(turn.at[1 - wg_idx])

            plgpu.wgmma_wait(0)
            real = mosaic._row_iota((block_m, tile_n)) < num_real
            values = tuple(jnp.where(real, acc[...], 0.0) for acc in accs)

            # Inactive blocks are left unwritten (mosaic._gmm_padded).
            @pl.when(steps > 0)
            def _():
              plgpu.barrier_arrive(consumed.at[lax.rem(step0 + steps - 1, slots)])
              pre_tile = lambda i, j: mosaic._load_wgmma(
                  pre_smem.at[pre_idx(i) + (slice(None), pl.ds(j * epi_n, epi_n))]).astype(jnp.float32)
              piece_real = lambda j: real[:, j * epi_n:(j + 1) * epi_n]
              if num_pre:
                plgpu.barrier_wait(pre_ready.at[wg_idx])
              epilogue = mosaic.gmm_epilogue(activation, num_w, num_pre, pre_tile, piece_real)
              # The stores overlap the other consumer's K loop (and this one's next).
              mosaic._store_tile(values, out_smem, [o.at[rows_, cols] for o in out_gmems], wg_idx,
                                 epi_n, epilogue)

          return step0 + steps + tile(local + 1)[3]  # and the other consumer's next tile

        lax.fori_loop(0, own_tiles, one_tile, jnp.where(wg_idx == 1, tile(0)[3], 0))
        plgpu.wait_smem_to_gmem(0)

  out_shape = jax.ShapeDtypeStruct((rows, n), out_dtype)
  args = (row_block_expert, row_block_rows, lhs, *weights, *pre)
  if order is not None:
    args = (order,) + args
  return mosaic._launch(body, (out_shape,) * num_out if num_out > 1 else out_shape, *args,
                        name=mosaic.gmm_kind(weights, pre, activation, transpose_rhs) + "_pingpong")
