"""What pairing two experts' light tails in one gmm tile would buy: a paired tile's cost alone, then
pairs in the E64 layouts' real tile loop.

The layout pads every expert to whole 128-row blocks, so an expert whose rows end in a block's first
half leaves a light tile: one consumer warpgroup with rows, the other idle. A light tile costs h =
0.8-0.93 of a full one on an H200 and an H100 (probe_gmm_waves.py --light-cost). Two experts' light
tails in one tile, each consumer multiplying its own expert's weights, would save 2h - h_pair tiles a
pair, where h_pair is what such a tile costs. Its producer streams two weight tiles a K step where a
full tile streams one, so h_pair lies between 1 (rows are the cost) and 2h (the weight stream is).
The layout itself keeps its guarantee that a block never spans two experts: a pair is a unit of work
over two blocks' first halves, whose consumers also store zeros to the blocks' second halves.

--parts tiles: the cooperative gmm's persistent loop (mosaic._gmm_padded's main loop: TMA ring,
producer and two consumer warpgroups) over uniform row blocks in planar-snake order (the config's
grid fields; no expert_band_order, no split tail), each block's two 64-row halves tagged with an
expert, in three modes:

  full   one weight stream a tile; both consumers multiply it (today's full tile)
  light  one weight stream; consumer 1 issues no wgmma and stores zeros (today's light tile)
  pair   two weight streams a tile; consumer j multiplies stream j (the paired tile)

Every mode writes the whole [rows, n] output, so t(mode) / t(full) is a tile's cost in full tiles.
A pair's two streams per stage need twice the weight slots, so at the default 128 x 256 tiles its
ring is 2 deep, not 4; it also runs with 128-wide N tiles on a 4-deep ring (pair_n128), and the full
tile runs on both of those configs too (full_r2, full_n128), so each config's cost is read apart.

--parts layouts: bench_moe_layer's E64 top-1 routings (plain and skewed), one loop of items in
expert_band_order (mixed_items, mixed_gmm): today's tiles, or with consecutive light blocks paired
(each pair as two 128-wide items in the place of its first block's tile, so its weight tiles stay
near their experts' full tiles in L2). Each item enters its kind's pipeline as a shared-memory scope
of its own; `unpaired` (per-item scopes, no pairs) separates that cost from the pairing's, and
`unpaired_hoisted` (one scope for the loop, as the library; `_inactive` with the inactive blocks'
zero-step items kept, as the library runs them) and the library's gmm stand beside them.

Measured on an H200 (notes_hopper_kernels.md, forty-second session;
results/paired_tile_probe{,_layouts}_H200*): alone, h = 0.79-0.82 and h_pair = 1.26-1.28 (128-wide
pairs on a 4-deep ring), so a pair would save 0.31-0.35 tiles; in the real loops pairing moved the
product by -2.9% to +3.7% against the same per-item scopes, which themselves cost 0.7-6.8%. Not built.

GPU:  python experiments/probe_paired_tile.py [--parts tiles,layouts] [--out-dir DIR]
CPU:  tests/test_experiments.py interprets every mode and the mixed loop against their references.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from peers import common  # noqa: E402
from sparsejax.kernels.gmm import mosaic  # noqa: E402

BLOCK, HALF = 128, 64
MODES = ("full", "light", "pair")
# (name, mode, config changes over mosaic.DEFAULT_CONFIGS.gmm), each fitted to shared memory.
# A pair's two weight tiles a stage leave room for a 2-deep ring at the default 128 x 256 tiles
# (full_r2 is the full tile on that ring) or a 4-deep one at 128 x 128 (full_n128 its full tile).
# 32-deep K steps, which would keep 256-wide tiles on a 4-deep ring, fail Mosaic GPU's layout
# inference for wgmma.
VARIANTS = (("full", "full", {}), ("light", "light", {}), ("pair", "pair", dict(max_concurrent_steps=2)),
            ("full_r2", "full", dict(max_concurrent_steps=2)), ("pair_n128", "pair", dict(tile_n=128)),
            ("full_n128", "full", dict(tile_n=128)))
# (name, K, N): h W_out and x W_in of the E64 top-1 MLP (d 1,024, f 4,096).
SHAPES = (("h_W_out", 4096, 1024), ("x_W_in", 1024, 4096))
ROW_BLOCKS, EXPERTS = 160, 64  # E64 top-1's 20,480 padded rows (16,384 tokens), 64 experts
# Items name their first column in these units: a column offset read from memory as it is fails Mosaic
# GPU's layout inference (jax 0.10.2), a multiple of a constant lowers (as mosaic._gmm_padded's).
COL_UNIT = 64


def fitted(cfg: mosaic.Config, mode: str, k: int, n: int) -> mosaic.Config:
  streams = 2 if mode == "pair" else 1
  return mosaic._fit(cfg, k, n, stage_bytes=lambda c: (BLOCK + streams * c.tile_n) * c.tile_k * 2,
                     out_bytes=lambda c: 2 * c.epi_slots * HALF * c.epi_tile_n * 2)


@functools.partial(jax.jit, static_argnames=("mode", "cfg"))
def tile_gmm(lhs, w, halves_expert, *, mode: str, cfg: mosaic.Config):
  """out[128 m + 64 j + i] = lhs[same row] @ w[e], e = halves_expert[m, j] (pair), halves_expert[m, 0]
  (full, light); zero for j = 1 in light mode. lhs [rows, K] with rows a multiple of 128, w [E, K, N]."""
  if mode not in MODES:
    raise ValueError(f"mode: one of {MODES}; got {mode!r}")
  rows, k = lhs.shape
  n = w.shape[2]
  tile_n, tile_k, epi_n = cfg.tile_n, cfg.tile_k, cfg.epi_tile_n
  if rows % BLOCK or k % tile_k or n % tile_n:
    raise ValueError(f"rows {rows} must divide by {BLOCK}, K {k} by tile_k {tile_k}, N {n} by tile_n {tile_n}")
  grid = (rows // BLOCK, n // tile_n)
  streams = 2 if mode == "pair" else 1
  delay = min(cfg.delay_release, cfg.max_concurrent_steps - 1)
  a_spec = plgpu.BlockSpec((BLOCK, tile_k), lambda s: (0, s), transforms=mosaic._transforms(tile_k, lhs.dtype),
                           delay_release=delay)
  b_spec = plgpu.BlockSpec((tile_k, tile_n), lambda s: (s, 0), transforms=mosaic._transforms(tile_n, w.dtype),
                           delay_release=delay)
  specs = [a_spec] + [b_spec] * streams
  ignore = lambda *_, **__: None

  def body(he_gmem, lhs_gmem, w_gmem, out_gmem):
    allocs = mosaic._warp_specialized(ignore, (cfg.max_concurrent_steps,), specs, cfg, ignore).get_allocations(
        lhs_gmem.at[pl.ds(0, BLOCK), :], *[w_gmem.at[0].at[:, pl.ds(0, tile_n)]] * streams)

    @functools.partial(
        pl.run_scoped, pipeline_allocs=allocs,
        out_smem=plgpu.SMEM((2, cfg.epi_slots, HALF, epi_n), lhs.dtype, transforms=mosaic._transforms(epi_n, lhs.dtype)),
        tile_done=plgpu.Barrier(num_arrivals=2), collective_axes="wg")
    def _scope(pipeline_allocs, out_smem, tile_done):
      wg_idx = lax.axis_index("wg")

      @plgpu.nd_loop((grid[0] * grid[1],), collective_axes="sm")
      def _tile(info):
        m_idx, n_idx = mosaic._tile_coords(info.index[0], grid, cfg)
        steps = jnp.int32(k // tile_k)
        m_slice, n_slice = pl.ds(m_idx * BLOCK, BLOCK), pl.ds(n_idx * tile_n, tile_n)
        wg_m = pl.ds(wg_idx * HALF, HALF)

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc=plgpu.ACC((HALF, tile_n), jnp.float32))
          def _acc(acc):
            eval_pipeline((acc,))
            value = acc[...]
            mosaic._consumer_done(steps, tile_done)
            mosaic._store_tile((value,), out_smem, [out_gmem.at[m_slice, n_slice].at[wg_m]], wg_idx, epi_n)

        def mma(_, a_smem, *refs):
          *b_smems, accs = refs
          for j, b_smem in enumerate(b_smems):
            # pair: consumer j takes stream j; full: both take stream 0; light: consumer 0 only.
            @pl.when((wg_idx == j) if mode == "pair" else (wg_idx == 0) if mode == "light" else True)
            def _():
              plgpu.wgmma(accs[0], a_smem.at[wg_m], b_smem)

          plgpu.wgmma_wait(delay)
          return accs

        experts = [he_gmem[m_idx, j] for j in range(streams)]
        mosaic._warp_specialized(mma, (steps,), specs, cfg, compute_context)(
            lhs_gmem.at[m_slice, :], *[w_gmem.at[e].at[:, n_slice] for e in experts], allocations=pipeline_allocs)
        mosaic._producer_waits_for_tile(wg_idx, steps, tile_done)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return mosaic._launch(body, jax.ShapeDtypeStruct((rows, n), lhs.dtype), halves_expert, lhs, w,
                        name=f"paired_probe_{mode}")


def reference(lhs, w, halves_expert, mode: str):
  """tile_gmm's output in float32: each 64-row half times its expert's weight."""
  he = halves_expert if mode == "pair" else jnp.repeat(halves_expert[:, :1], 2, axis=1)
  halves = lhs.reshape(-1, HALF, lhs.shape[1]).astype(jnp.float32)
  out = jnp.einsum("hik,hkn->hin", halves, w[he.reshape(-1)].astype(jnp.float32))
  if mode == "light":
    out = out.reshape(-1, 2, HALF, w.shape[2]).at[:, 1].set(0.0)
  return out.reshape(lhs.shape[0], w.shape[2])


def problem(row_blocks: int, k: int, n: int, experts: int, seed=0):
  """(lhs, w, halves_expert): block m belongs to expert m * E // row_blocks (E64 top-1's 2.5 blocks an
  expert, in order, as the layout places them); its second half's pair partner is the next expert."""
  keys = jax.random.split(jax.random.key(seed), 2)
  lhs = jax.random.normal(keys[0], (row_blocks * BLOCK, k), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (experts, k, n)) / k ** 0.5).astype(jnp.bfloat16)
  e = jnp.arange(row_blocks, dtype=jnp.int32) * experts // row_blocks
  return lhs, w, jnp.stack([e, (e + 1) % experts], axis=1)


# ------------------------------------------------------------------------------------------------
# The pairs in a real layout: one loop of full items and paired items, in expert_band_order.
# ------------------------------------------------------------------------------------------------
def mixed_items(row_block_expert, row_block_rows, expert_block_offsets, n: int, *, tile_n: int, width: int,
                pair_n: int, paired: bool, inactive: bool = False) -> np.ndarray:
  """[items, 4] int32 rows (kind, block_a, block_b, first column / COL_UNIT) walking expert_band_order's tiles.

  Kind 0 runs one row block's [128, tile_n] tile (a light block's consumer 1 idles, as today); kind 1
  a pair of light blocks (real rows 1-64) a and b over pair_n columns, consumer 0 on a's rows and
  weights, consumer 1 on b's. With `paired`, consecutive light blocks pair up (neighbouring experts
  in the layout) and a pair's items take block a's place in the order, b's tiles dropping out; an
  odd light block left over runs as today. Inactive blocks are left out, or with `inactive` kept where
  the order puts them (last), as the library's loop runs them: zero K steps, nothing stored."""
  rows = np.asarray(row_block_rows)
  n_iters = n // tile_n
  order = np.asarray(mosaic.expert_band_order(jnp.asarray(row_block_expert), jnp.asarray(expert_block_offsets),
                                              n_iters, width))
  light = np.flatnonzero((rows > 0) & (rows <= HALF))
  partner = {}
  if paired:
    for a, b in zip(light[0::2], light[1::2]):
      partner[int(a)], partner[int(b)] = int(b), -1
  items = []
  for code in order:
    m, col = divmod(int(code), n_iters)
    if (rows[m] == 0 and not inactive) or partner.get(m) == -1:
      continue
    if m in partner:
      items += [(1, m, partner[m], (col * tile_n + j) // COL_UNIT) for j in range(0, tile_n, pair_n)]
    else:
      items.append((0, m, m, col * tile_n // COL_UNIT))
  return np.asarray(items, np.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "pair_n", "hoist"))
def mixed_gmm(items, row_block_expert, row_block_rows, lhs, w, *, cfg: mosaic.Config, pair_n: int = 128,
              hoist: bool = False):
  """out[r] = lhs[r] @ w[e(r)] on the real rows of the blocks items names, zero on their other rows.

  Each item runs in its kind's pipeline, entered as its own shared-memory scope (kind 0: A [128,
  tile_k] and B [tile_k, tile_n] a stage; kind 1: two A [64, tile_k] and two B [tile_k, pair_n]),
  the two scopes over the same memory. hoist: every item is kind 0, and its scope is entered once
  for the loop, as mosaic._gmm_padded does (what entering a scope per item costs)."""
  rows, k = lhs.shape
  n = w.shape[2]
  tile_n, tile_k, epi_n, ring = cfg.tile_n, cfg.tile_k, cfg.epi_tile_n, cfg.max_concurrent_steps
  k_iters = k // tile_k
  delay = min(cfg.delay_release, ring - 1)
  dt = lhs.dtype
  spec = lambda shape, index: plgpu.BlockSpec(shape, index, transforms=mosaic._transforms(shape[1], dt),
                                              delay_release=delay)
  a_of = lambda r: spec((r, tile_k), lambda s: (0, s))
  b_of = lambda c: spec((tile_k, c), lambda s: (s, 0))
  single_specs, pair_specs = [a_of(BLOCK), b_of(tile_n)], [a_of(HALF), a_of(HALF), b_of(pair_n), b_of(pair_n)]
  ignore = lambda *_, **__: None
  ws = lambda body, steps, specs, context: mosaic._warp_specialized(body, (steps,), specs, cfg, context)

  def body(items_gmem, rbe_gmem, rbr_gmem, lhs_gmem, w_gmem, out_gmem):
    w0 = w_gmem.at[0]
    single_allocs = ws(ignore, ring, single_specs, ignore).get_allocations(
        lhs_gmem.at[pl.ds(0, BLOCK), :], w0.at[:, pl.ds(0, tile_n)])
    pair_allocs = ws(ignore, ring, pair_specs, ignore).get_allocations(
        *[lhs_gmem.at[pl.ds(0, HALF), :]] * 2, *[w0.at[:, pl.ds(0, pair_n)]] * 2)

    @functools.partial(pl.run_scoped, collective_axes="wg", tile_done=plgpu.Barrier(num_arrivals=2),
                       out_smem=plgpu.SMEM((2, cfg.epi_slots, HALF, epi_n), dt, transforms=mosaic._transforms(epi_n, dt)))
    def _outer(tile_done, out_smem):
      wg_idx = lax.axis_index("wg")
      wg_m = pl.ds(wg_idx * HALF, HALF)

      def consumer_tile(width, num_real, steps, dests):
        """The compute context: the accumulator, its real rows kept, stored to dests (ref, zero?)."""
        def context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc=plgpu.ACC((HALF, width), jnp.float32))
          def _(acc):
            eval_pipeline((acc,))
            row = mosaic._row_iota((HALF, width))
            value = jnp.where(row < num_real, acc[...], 0.0)
            # A constant would carry no register layout for the store.
            zeros = jnp.where(row < 0, value, 0.0) if any(zero for _, zero in dests) else None
            mosaic._consumer_done(steps, tile_done)

            @pl.when(steps > 0)
            def _():
              for ref, zero in dests:
                mosaic._store_tile((zeros if zero else value,), out_smem, [ref], wg_idx, epi_n)
        return context

      def single(i, allocs):
        m, col = items_gmem[i, 1], items_gmem[i, 3] * COL_UNIT
        num_real = rbr_gmem[m]
        steps = jnp.where(num_real > 0, k_iters, 0)
        has_rows = (num_real > wg_idx * HALF) & (steps > 0)
        m_slice, n_slice = pl.ds(m * BLOCK, BLOCK), pl.ds(col, tile_n)

        def mma(_, a_smem, b_smem, accs):
          @pl.when(has_rows)
          def _():
            plgpu.wgmma(accs[0], a_smem.at[wg_m], b_smem)
          plgpu.wgmma_wait(delay)
          return accs

        dest = [(out_gmem.at[m_slice, n_slice].at[wg_m], False)]
        ws(mma, steps, single_specs, consumer_tile(tile_n, num_real - wg_idx * HALF, steps, dest))(
            lhs_gmem.at[m_slice, :], w_gmem.at[rbe_gmem[m]].at[:, n_slice], allocations=allocs)
        mosaic._producer_waits_for_tile(wg_idx, steps, tile_done)

      def pair(i, allocs):
        a, b, col = items_gmem[i, 1], items_gmem[i, 2], items_gmem[i, 3] * COL_UNIT
        mine = jnp.where(wg_idx == 1, b, a)
        steps = jnp.int32(k_iters)
        n_slice = pl.ds(col, pair_n)

        def mma(_, a0, a1, b0, b1, accs):
          for j, (a_smem, b_smem) in enumerate(((a0, b0), (a1, b1))):
            @pl.when(wg_idx == j)
            def _():
              plgpu.wgmma(accs[0], a_smem, b_smem)
          plgpu.wgmma_wait(delay)
          return accs

        block = out_gmem.at[pl.ds(mine * BLOCK, BLOCK), n_slice]
        dests = [(block.at[pl.ds(0, HALF)], False), (block.at[pl.ds(HALF, HALF)], True)]
        ws(mma, steps, pair_specs, consumer_tile(pair_n, rbr_gmem[mine], steps, dests))(
            lhs_gmem.at[pl.ds(a * BLOCK, HALF), :], lhs_gmem.at[pl.ds(b * BLOCK, HALF), :],
            w_gmem.at[rbe_gmem[a]].at[:, n_slice], w_gmem.at[rbe_gmem[b]].at[:, n_slice], allocations=allocs)
        mosaic._producer_waits_for_tile(wg_idx, steps, tile_done)

      if hoist:
        @functools.partial(pl.run_scoped, allocs=single_allocs, collective_axes="wg")
        def _(allocs):
          @plgpu.nd_loop((items.shape[0],), collective_axes="sm")
          def _(info):
            single(info.index[0], allocs)
      else:
        @plgpu.nd_loop((items.shape[0],), collective_axes="sm")
        def _(info):
          i = info.index[0]
          for kind, run, allocs in ((0, single, single_allocs), (1, pair, pair_allocs)):
            @pl.when(items_gmem[i, 0] == kind)
            def _(run=run, allocs=allocs):
              pl.run_scoped(lambda scoped: run(i, scoped), allocs, collective_axes="wg")

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stores read out_smem

  return mosaic._launch(body, jax.ShapeDtypeStruct((rows, n), dt), items, row_block_expert, row_block_rows,
                        lhs, w, name="paired_probe_mixed" + ("_hoisted" if hoist else ""))


def layout_reference(lhs, w, row_block_expert, row_block_rows):
  """[blocks, 128, N] float32: each block's real rows times its expert's weights, zero below them."""
  blocks = lhs.reshape(-1, BLOCK, lhs.shape[1]).astype(jnp.float32)
  out = jnp.einsum("bik,bkn->bin", blocks, w[row_block_expert].astype(jnp.float32))
  return jnp.where(jnp.arange(BLOCK)[None, :, None] < row_block_rows[:, None, None], out, 0.0)


def layout_error(got, want, row_block_rows) -> float:
  """rel_err over the active blocks (the kernels leave inactive ones unwritten)."""
  active = np.flatnonzero(np.asarray(row_block_rows) > 0)
  got = got.reshape(want.shape)[active]
  return common.rel_err(got, want[active])


def timed(calls: dict, rounds: int, timer) -> dict[str, list[float]]:
  """{name: [ms a round]}: rounds interleaved, each timing every call once."""
  ms = {name: [] for name in calls}
  for _ in range(rounds):
    for name, fn in calls.items():
      ms[name].append(timer(fn, jax.block_until_ready)["median_s"] * 1e3)
  return ms


def checked(name: str, err: float, detail: str = "") -> float:
  print(f"{name}: {detail}rel err against the float32 reference {err:.1e}", flush=True)
  if not err < 1e-2:
    raise SystemExit(f"{name}: output wrong (rel err {err:.2e})")
  return err


def tiles_part(rounds: int, timer) -> dict:
  """Each mode on uniform blocks: a tile's cost in full tiles."""
  out = {}
  for shape, k, n in SHAPES:
    lhs, w, he = problem(ROW_BLOCKS, k, n, EXPERTS)
    calls, res = {}, {"variants": {}}
    for name, mode, changes in VARIANTS:
      cfg = fitted(dataclasses.replace(mosaic.DEFAULT_CONFIGS.gmm, **changes), mode, k, n)
      calls[name] = functools.partial(tile_gmm, lhs, w, he, mode=mode, cfg=cfg)
      got = jax.block_until_ready(calls[name]())
      err = checked(f"{shape} {name}", common.rel_err(got, reference(lhs, w, he, mode)),
                    f"tile_n {cfg.tile_n} tile_k {cfg.tile_k} ring {cfg.max_concurrent_steps}, ")
      res["variants"][name] = dict(mode=mode, config=dataclasses.asdict(cfg), rel_err=err)
    ms = timed(calls, rounds, timer)
    med = {name: statistics.median(v) for name, v in ms.items()}
    full, h = med["full"], med["light"] / med["full"]
    h_pair = min(med[v] for v in med if v.startswith("pair")) / full
    for name in calls:
      res["variants"][name]["ms"] = ms[name]
    res.update(median_ms=med, h_light=h, h_pair=h_pair, saved_per_pair=2 * h - h_pair)
    out[shape] = res
    for name, m in med.items():
      print(f"{shape} {name:10s} {m:.4f} ms ({m / full:.3f} of full; rounds "
            + " ".join(f"{x:.4f}" for x in ms[name]) + ")", flush=True)
    print(f"{shape}: h (light) {h:.3f}, h_pair (best pair) {h_pair:.3f}: a pair saves {2 * h - h_pair:+.3f} tiles",
          flush=True)
  return out


def layouts_part(names: list[str], rounds: int, timer, shapes=SHAPES) -> dict:
  """On bench_moe_layer's routings: the library's gmm, the mixed loop unpaired (its scope entered once
  for the loop, or per item) and paired, each against the float32 reference on the active blocks."""
  import bench_moe_layer
  from peers import sparsejax_variants

  routings = {s.name: s for s in bench_moe_layer.SHAPES + bench_moe_layer.SMOKE_SHAPES}
  out = {}
  for layout in names:
    _, topo, _ = sparsejax_variants.padded_layout(common.make_problem(routings[layout]))
    rbe, rbr, ebo = topo.row_block_expert, topo.row_block_rows, topo.expert_block_offsets
    rows_np = np.asarray(rbr)
    light = int(((rows_np > 0) & (rows_np <= HALF)).sum())
    for shape, k, n in shapes:
      keys = jax.random.split(jax.random.key(1), 2)
      real = (jnp.arange(BLOCK)[None, :] < rbr[:, None]).reshape(-1, 1)
      # Padding rows zero, as the layout's (a wgmma on zeros costs less energy than on random bits).
      lhs = jnp.where(real, jax.random.normal(keys[0], (rbr.shape[0] * BLOCK, k), jnp.bfloat16), 0)
      w = (jax.random.normal(keys[1], (routings[layout].E, k, n)) / k ** 0.5).astype(jnp.bfloat16)
      want = layout_reference(lhs, w, rbe, rbr)
      cfg = fitted(mosaic.DEFAULT_CONFIGS.gmm, "full", k, n)
      mixed = functools.partial(mixed_items, rbe, rbr, ebo, n, tile_n=cfg.tile_n, width=cfg.grid_tile_width,
                                pair_n=cfg.tile_n // 2)
      items = {p: jnp.asarray(mixed(paired=p)) for p in (False, True)}
      library = jax.jit(lambda lhs, w, topo: mosaic.gmm(lhs, w, topo, False, jnp.bfloat16))
      loop = functools.partial(mixed_gmm, row_block_expert=rbe, row_block_rows=rbr, lhs=lhs, w=w, cfg=cfg,
                               pair_n=cfg.tile_n // 2)
      calls = {"library_gmm": functools.partial(library, lhs, w, topo),
               # today's loop as the library runs it, less the split tail: inactive blocks' zero-step items kept
               "unpaired_hoisted_inactive": functools.partial(loop, jnp.asarray(mixed(paired=False, inactive=True)),
                                                              hoist=True),
               "unpaired_hoisted": functools.partial(loop, items[False], hoist=True),
               "unpaired": functools.partial(loop, items[False]),
               "paired": functools.partial(loop, items[True])}
      key = f"{layout} {shape}"
      res = {"active_blocks": int((rows_np > 0).sum()), "light_blocks": light,
             "items": {p: int(v.shape[0]) for p, v in (("unpaired", items[False]), ("paired", items[True]))},
             "rel_err": {name: checked(f"{key} {name}", layout_error(jax.block_until_ready(fn()), want, rbr))
                         for name, fn in calls.items()}}
      res["ms"] = timed(calls, rounds, timer)
      med = {name: statistics.median(v) for name, v in res["ms"].items()}
      res["median_ms"] = med
      out[key] = res
      print(f"{key}: {res['active_blocks']} active blocks, {light} light; items {res['items']}", flush=True)
      for name, m in med.items():
        print(f"{key} {name:25s} {m:.4f} ms ({m / med['unpaired_hoisted']:.3f} of unpaired_hoisted; rounds "
              + " ".join(f"{x:.4f}" for x in res["ms"][name]) + ")", flush=True)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--parts", default="tiles,layouts", help="tiles (uniform blocks), layouts (bench routings)")
  ap.add_argument("--layouts", default="E64_top1,E64_top1_skewed")
  ap.add_argument("--out-dir", default="")
  args = ap.parse_args(argv)
  parts = args.parts.split(",")
  if set(parts) - {"tiles", "layouts"}:
    ap.error(f"--parts: tiles, layouts; got {args.parts!r}")
  if jax.default_backend() != "gpu":
    raise SystemExit("probe_paired_tile times compiled Mosaic GPU kernels: run it on an sm_90 GPU "
                     "(tests/test_experiments.py interprets it on the CPU)")
  from provenance import source_fingerprint

  timer = common.Timer(min_repeat_s=0.1, repeats=7)  # 0.7 s a sample: the card reaches its power cap
  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "source": source_fingerprint(),
             "row_blocks": ROW_BLOCKS, "experts": EXPERTS}
  if "tiles" in parts:
    results["shapes"] = tiles_part(args.rounds, timer)
  if "layouts" in parts:
    results["layouts"] = layouts_part(args.layouts.split(","), args.rounds, timer)
  if args.out_dir:
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "paired_tile_probe.json"), "w") as f:
      json.dump(results, f, indent=1)
  return results


if __name__ == "__main__":
  main()
