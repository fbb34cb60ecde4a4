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
Inactive row blocks (no real row) run a pipeline of zero steps and store nothing: their output
rows are left unwritten (op.py's contract), and an expert with no rows gets tgmm's zero gradient
from its zero-step reduction. Rows that hold no token
(an expert's last block is padded up to 128 rows) cost nothing where a whole 64-row wgmma is
padding: gmm's consumer of that half issues no wgmma, and tgmm stops its reduction at the
expert's last real row (masking the padding rows of its last step).

The plain products' persistent loop (gmm, gmm_t) ends with a partial wave: a few SMs would each
run one more whole tile while the rest idle. With Config(split_tail=True) those tiles run as half-
or quarter-width column pieces, one an SM, from a pipeline of their own after the main loop
(tail_split).

gmm's tile order is `expert_band_order`: planar-snake bands of at most grid_tile_width row
blocks that never straddle two experts, so the CTAs in flight share each expert's weight tiles
in L2 and read them from DRAM once (plain `planar_snake` over all row blocks with
Config(expert_bands=False) ran the E64 shapes' expert MLP 1-2.5% slower and E64 top-8's gmm_act
7% slower: experiments/results/expert_mlp_ab_schedules_H100.log). tgmm walks the experts heaviest first, every second wave of the persistent
loop backwards, so a busy expert's long reductions do not all land on neighbouring SMs (see
_tgmm_item; -10 to -20% under a training run's routing skew, equal under uniform routing).

The expert MLP (mlp.py) uses epilogue variants of gmm: gmm_act stores pre and act(pre) of the
float32 accumulator, and gmm_dact, whose consumers TMA-load their pre tile while the K loop runs,
stores acc * act'(pre). With SaveDerivative(act) gmm_act stores act'(pre) in pre's place (one
sigmoid serves both) and gmm_dact (activation=None) multiplies by it: mlp.py's form wherever
saves_derivative allows. For the GLU form, gmm_glu keeps two accumulators per consumer (x W_gate
and x W_in over the same lhs tile) and stores g, u and act(g) * u; gmm_dglu loads g and u and
stores dh * u * act'(g) and dh * act(g). No separate pass then touches the [rows, d_ff] activations.
The epilogues compute sparsejax.activations' kernel forms (exp and rsqrt, no tanh or division),
compiled with approximate math: a special-function instruction each, within a few float32 ulps.
Config(epilogue_wg=True) runs gmm_act / gmm_dact from mosaic_epilogue.py instead, where a fourth
warpgroup does the epilogue while the consumers go on to the next tile: Configs.gmm_act_long, which
gmm_for picks for gmm_act when experts average LONG_ROWS rows or more (there gmm_act ran 5-14%
faster; gmm_dact's form lost 17% everywhere and stays opt-in). Below that, gmm_act and gmm_dact
run on the ping-pong schedule (Config(pingpong=True), mosaic_pingpong.gmm_padded: each consumer
owns whole 128 x 128 tiles and one's epilogue runs under the other's wgmmas); _gmm_padded's
cooperative form of them stays (COOPERATIVE_ACT / COOPERATIVE_DACT; gmm_dact_long).

tgmm has three schedules: a pipeline per output tile (_tgmm_padded, the default), one
TMA ring over all of a CTA's tiles (Config(streamed=True), _tgmm_streamed; opt-in, within the
spread in the MLP), and ping-pong (Config(pingpong=True), mosaic_pingpong.py: each consumer owns
whole 128 x tile_n tiles and the two alternate, so one's epilogue runs under the other's wgmmas),
which Configs.tgmm_short picks for experts of fewer than SHORT_ROWS rows on average
(experiments/results/expert_mlp_ab_schedules_H100.log).

Contract and custom_vjp: op.py (mlp.py for the fused MLP). Reference: reference.py. Float32 operands go to the Triton
backend: wgmma reads float32 as TF32, and float32 users get float32 answers.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from sparsejax.activations import DERIVATIVES, PLAIN, VALUE_AND_DERIVATIVE
from sparsejax.kernels.gmm.padding import pad_to
from sparsejax.kernels.shared_lowering import call_shared
from sparsejax.topology import Topology

M_DIM, N_DIM = 0, 1


@dataclasses.dataclass(frozen=True)
class SaveDerivative:
  """gmm_act's activation when its first output is act'(pre) instead of pre (gmm_act's docstring):
  a key of sparsejax.activations.VALUE_AND_DERIVATIVE."""
  activation: object


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles of one kernel.

  gmm: the CTA tile is block_m (128) x tile_n; each consumer warpgroup owns 64 of its rows.
  (A 64-row CTA tile, which would skip the padding half of an expert's last block outright,
  measured 35-50% slower on an H100: experiments/results/gmm_kernels_*.json.)
  tgmm: the CTA tile is block_m (128, of K) x (2 * tile_n); each consumer owns tile_n columns,
  and tile_k rows of the reduction (64 or 128: it divides the row block) are one step.
  gmm and tgmm with pingpong: the CTA tile is block_m x tile_n (at most 128; 64 for the GLU forms'
  two accumulators), each consumer owns whole tiles in turn, through one ring of
  max_concurrent_steps slots for both.
  """
  tile_n: int = 256
  tile_k: int = 64
  max_concurrent_steps: int = 4
  epi_tile_n: int = 64
  grid_minor_dim: int = M_DIM
  grid_tile_width: int = 4
  delay_release: int = 1
  epi_slots: int = 2  # gmm: smem slots the epilogue's TMA stores rotate through
  # gmm_act / gmm_dact: a fourth warpgroup runs the epilogue while the consumers go on to the next
  # tile (mosaic_epilogue.py; 128 x tile_n tiles, the activation of the bf16-rounded product).
  epilogue_wg: bool = False
  # tgmm: walk the experts heaviest first, every second wave of num_sms tiles backwards (see
  # _tgmm_item). False: experts in index order, as before (kept for A/B runs).
  balance_experts: bool = True
  # tgmm and every gmm kind: the ping-pong schedule (mosaic_pingpong.py): each consumer
  # owns whole tiles and the two alternate, one's epilogue under the other's wgmmas.
  pingpong: bool = False
  # gmm: walk the output tiles in expert_band_order (planar-snake bands of at most grid_tile_width
  # row blocks that never straddle two experts, so each expert's weight tiles are read from DRAM
  # once) instead of plain planar_snake over all row blocks. M-minor orders only.
  expert_bands: bool = False
  # tgmm: one hand-written ring over all of a CTA's tiles (_tgmm_streamed), so the producer loads
  # the next tile's rows while the consumers finish this one and store it; epi_slots pieces of
  # epi_tile_n columns buffer the stores. False: a pipeline per tile (_tgmm_padded).
  streamed: bool = False
  # gmm, cooperative kernel with expert_bands: the persistent loop's last, partial wave (the active
  # tiles past a multiple of the SMs) runs as half- or quarter-width column pieces side by side
  # (tail_split), so its few SMs do not each run one whole tile while the rest idle.
  split_tail: bool = False


# mosaic._gmm_padded's (the cooperative kernel's) best configs for gmm_act and gmm_dact, the
# defaults before the ping-pong kernel. gmm_act: 128-wide N tiles with a 6-deep ring ran 0.759 /
# 0.406 ms against 0.834 / 0.427 for 256-wide tiles with 4 slots (MoE-XS at 128 x 1024 tokens /
# E64 top-1; experiments/results/act_kernels_sweep_H100.log). gmm_dact: a 128-wide N tile leaves
# room for the pre tile beside a 5-deep ring.
COOPERATIVE_ACT = Config(tile_n=128, max_concurrent_steps=6, epi_tile_n=64, grid_tile_width=8, expert_bands=True)
COOPERATIVE_DACT = Config(tile_n=128, max_concurrent_steps=5, epi_tile_n=64, grid_tile_width=8, expert_bands=True)


@dataclasses.dataclass(frozen=True)
class Configs:
  # h W_out and dX W_in^T. split_tail: on the skewed E64 top-1 MLP (672 tiles of 128 x 256, 12 past
  # five waves of 132) each ran 20 us (6%) faster with the last wave in quarter pieces, and the same
  # where no tail was cut (E64 top-1, 640 tiles). The pieces' pipeline takes the main one's tile_k
  # and ring: deeper rings or K steps of 128 or 256 for them ran within 2-4 us of it
  # (experiments/results/split_tail_H100.log).
  gmm: Config = Config(grid_tile_width=8, expert_bands=True, split_tail=True)
  gmm_t: Config = Config(expert_bands=True, split_tail=True)
  # x W_in writing (pre, act(pre)) and dY W_out^T * act'(pre): the ping-pong schedule
  # (mosaic_pingpong.gmm_padded), one consumer's epilogue under the other's wgmmas, one 6-deep ring
  # (gmm_dact's pre tiles leave room for 4). On an H200, gmm_act ran 0.322 ms against 0.364 for
  # the cooperative kernel (COOPERATIVE_ACT) at E64 top-1 and 0.462 against 0.492 at E64 top-8,
  # gmm_dact 0.349-0.368 against 0.389 and 0.502-0.525 against 0.520; the expert MLP fwd+bwd 3.3%
  # and 1.8% faster in 5 interleaved rounds (experiments/results/act_kernels_pingpong_H200.log).
  gmm_act: Config = Config(pingpong=True, tile_n=128, max_concurrent_steps=6, epi_tile_n=32,
                           grid_tile_width=8, expert_bands=True)
  # gmm_act when experts average LONG_ROWS rows or more: the epilogue in a fourth warpgroup
  # (mosaic_epilogue.py) while the consumers go on to the next tile. In interleaved A/B rounds on an
  # H100 gmm_act ran 11-14% faster at MoE-XS's 128 x 1024 tokens (2,048 rows an expert) and 5-13%
  # at E8 top-2 (4,224), the MLP 0-3% faster; at 1,088 rows (E64 top-8) it tied, at 320 (E64 top-1)
  # it lost 0-2% (experiments/results/expert_mlp_ab_epilogue_wg_act*_H100.log). Its gmm_dact
  # counterpart lost 17% at every length. Below LONG_ROWS the ping-pong kernel (gmm_act) won.
  gmm_act_long: Config = Config(epilogue_wg=True, tile_n=128, max_concurrent_steps=4, epi_tile_n=64,
                                grid_tile_width=8)
  # gmm_dact since gmm_act saves act'(pre): on E64 top-1 (skewed or not) the cooperative kernel's
  # 128 x 256 tiles tied it, its 128 x 128 tiles lost 3-4%, and pre read from global memory (no pre
  # tiles, a 6-slot ring) lost 5% skewed (H100, results/dact_schedules_ab_H100.log).
  gmm_dact: Config = Config(pingpong=True, tile_n=128, max_concurrent_steps=6, epi_tile_n=32,
                            grid_tile_width=8, expert_bands=True)
  # gmm_dact at LONG_ROWS rows an expert or more (E8 top-2, MoE-XS): the cooperative kernel, as
  # before the ping-pong one, which is not measured there yet.
  gmm_dact_long: Config = COOPERATIVE_DACT
  # GLU: two weight tiles per stage and two accumulators per consumer, so 128-wide tiles (two
  # 64x256 float32 accumulators would not fit the registers). Untuned.
  gmm_glu: Config = Config(tile_n=128, grid_tile_width=8, epi_slots=3, epi_tile_n=32, expert_bands=True)
  # gmm_glu when experts average fewer than SHORT_ROWS rows: the ping-pong schedule, each
  # consumer's two [128, 64] accumulators. On an H100 it ran E64 top-1's (320 rows an expert)
  # 0.626 ms against 0.706 for gmm_glu's config, and lost E64 top-8's (1,152) 0.971 against 0.900
  # (experiments/results/glu_fusion_pingpong_H100.log). In the GLU expert MLP fwd+bwd the gain did
  # not show: 3.125 against 3.134 ms in 5 interleaved rounds, outputs bit-identical
  # (results/glu_short_pingpong_ab_H100.log); kept for the kernel's gain, at no cost to the MLP.
  gmm_glu_short: Config = Config(pingpong=True, tile_n=64, max_concurrent_steps=6, epi_tile_n=32,
                                 grid_tile_width=8, expert_bands=True)
  gmm_dglu: Config = Config(tile_n=128, epi_tile_n=64, grid_tile_width=8, expert_bands=True)
  tgmm: Config = Config(tile_n=128, tile_k=64, max_concurrent_steps=4, epi_tile_n=32,
                        grid_tile_width=1)
  # tgmm when experts average LONG_ROWS rows or more (E8 top-2: 4,224): walking N fastest ran
  # 713-734 TFLOP/s against 586-618 for tgmm's order in three H100 runs; on 384 rows an expert
  # (E64 top-1) it lost 12%, on 1,152 (E64 top-8) it tied (experiments/results/tgmm_sweep_H100.log).
  tgmm_long: Config = Config(tile_n=128, tile_k=64, max_concurrent_steps=4, epi_tile_n=32,
                             grid_minor_dim=N_DIM, grid_tile_width=1)
  # tgmm when experts average fewer than SHORT_ROWS rows (E64 top-1: about 320 with padding): the
  # ping-pong schedule. With a ring per consumer (4 deep each), on E64 top-1's random routing both
  # weight gradients ran 0.401 / 0.387 ms against 0.454 / 0.420 for tgmm's config; on E64 top-8
  # (1,088 rows an expert) it lost 4% of the MLP (results/expert_mlp_ab_schedules_H100.log). One
  # ring of 6 for both consumers then ran them at 0.327 / 0.324 against the two rings' 0.421 /
  # 0.399 and the expert MLP at 1.963 ms against 2.084 (H100, 5 interleaved rounds; 8 deep tied;
  # results/tgmm_one_ring_ab_H100.log). On E64 top-8 one ring ran the kernels 5-10% faster than
  # tgmm's config but the MLP tied (3.054 against 3.047 ms), so tgmm keeps the per-tile schedule.
  tgmm_short: Config = Config(tile_n=128, tile_k=64, max_concurrent_steps=6, epi_tile_n=32,
                              grid_tile_width=1, pingpong=True)

  def with_tgmm(self, **changes) -> "Configs":
    """These configs with `changes` to every tgmm config (tgmm, tgmm_long, tgmm_short)."""
    return dataclasses.replace(self, **{k: dataclasses.replace(getattr(self, k), **changes)
                                        for k in ("tgmm", "tgmm_long", "tgmm_short")})

  def tgmm_for(self, rows: int, num_experts: int) -> Config:
    """The tgmm config for `rows` (padded) rows over `num_experts` experts, by rows per expert."""
    if rows >= LONG_ROWS * num_experts:
      return self.tgmm_long
    return self.tgmm_short if rows < SHORT_ROWS * num_experts else self.tgmm

  def gmm_for(self, kind: str, rows: int, num_experts: int) -> Config:
    """The config of gmm kernel `kind` (a field name) for `rows` padded rows over `num_experts`
    experts: gmm_act_long / gmm_dact_long for gmm_act / gmm_dact at LONG_ROWS rows an expert or
    more, gmm_glu_short for gmm_glu below SHORT_ROWS, else the kind's own."""
    if kind in ("gmm_act", "gmm_dact") and rows >= LONG_ROWS * num_experts:
      return getattr(self, f"{kind}_long")
    if kind == "gmm_glu" and rows < SHORT_ROWS * num_experts:
      return self.gmm_glu_short
    return getattr(self, kind)


LONG_ROWS = 2048
SHORT_ROWS = 512


# The defaults won or tied experiments/tune_gmm.py --sweep on an H100 (jax 0.11.2, bf16) for the
# issue's shapes (results in experiments/results/gmm_kernels_*.json). Read at call time, so a
# benchmark's tuning can set it.
DEFAULT_CONFIGS = Configs()

# Interpret mode (the CPU): the tiles the CPU tests exercise. jax 0.10.2's GPU interpreter runs
# these at the tests' shapes, where it stops on some 64-wide K tiles of a transposed wgmma operand
# ("'TransposeTransform' object has no attribute 'indices'"). Interpreting costs about a second a
# pipeline step on two CPU cores, so deep K steps and two-deep rings keep the tests affordable.
# Read at call time, as DEFAULT_CONFIGS.
_INTERPRET_ACT = Config(tile_n=256, tile_k=128, max_concurrent_steps=2, epi_tile_n=64, epi_slots=4)
# gmm_act and gmm_dact on the ping-pong schedule, as compiled; the cooperative kernel's forms have
# their own tests (INTERPRET_COOPERATIVE).
_INTERPRET_PINGPONG = Config(pingpong=True, tile_n=128, tile_k=128, max_concurrent_steps=2, epi_tile_n=32)
INTERPRET_COOPERATIVE = dict(gmm_act=_INTERPRET_ACT,
                             gmm_dact=Config(tile_n=128, tile_k=128, max_concurrent_steps=2, epi_tile_n=32))
INTERPRET_CONFIGS = Configs(
    gmm=Config(tile_n=256, tile_k=128, max_concurrent_steps=2),
    gmm_t=Config(tile_n=256, tile_k=128, max_concurrent_steps=2),
    gmm_act=_INTERPRET_PINGPONG,
    # No CPU test has LONG_ROWS rows an expert, and the epilogue-warpgroup kernel has its own tests
    # (test_mosaic_epilogue_warpgroup_*).
    gmm_act_long=_INTERPRET_ACT,
    gmm_dact=_INTERPRET_PINGPONG,
    gmm_dact_long=INTERPRET_COOPERATIVE["gmm_dact"],
    gmm_glu=Config(tile_n=128, tile_k=128, max_concurrent_steps=2, epi_tile_n=64, epi_slots=3),
    # The CPU tests' few rows would all take gmm_glu_short: the cooperative kernel here, the ping-pong
    # GLU kernel has its own tests (test_mosaic_pingpong_*).
    gmm_glu_short=Config(tile_n=128, tile_k=128, max_concurrent_steps=2, epi_tile_n=64, epi_slots=3),
    gmm_dglu=Config(tile_n=128, tile_k=128, max_concurrent_steps=2, epi_tile_n=64),
    tgmm=Config(tile_n=128, tile_k=64, max_concurrent_steps=2, epi_tile_n=32),
    tgmm_long=Config(tile_n=128, tile_k=64, max_concurrent_steps=2, epi_tile_n=32, grid_minor_dim=N_DIM),
    # The per-tile schedule at every length here: the CPU tests' few rows would otherwise all take
    # tgmm_short; the ping-pong kernel has its own tests (test_mosaic_pingpong_*).
    tgmm_short=Config(tile_n=128, tile_k=64, max_concurrent_steps=2, epi_tile_n=32))


def _configs(configs: Configs | None) -> Configs:
  """configs, else the defaults of where the kernels run (compiled on a GPU, or interpreted)."""
  if configs is not None:
    return configs
  return DEFAULT_CONFIGS if _interpret() is None else INTERPRET_CONFIGS


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
    return 2  # interpret mode: two "SMs", so each walks several tiles of the persistent loop
  return jax.devices()[0].core_count


def _transforms(minor_elems: int, dtype):
  swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


_SMEM_BYTES = 227 * 1024  # per block on sm_90


def _fit(cfg: Config, k: int, n: int, *, stage_bytes, out_bytes) -> Config:
  """Shrink tiles for small problems (tile_k, tile_n down to 64), then the epilogue tile, the ring
  (down to 2), tile_k and tile_n until shared memory holds them: stage_bytes(cfg) is one pipeline
  stage, out_bytes(cfg) the epilogue's buffers (a float32 output needs twice a bf16 one's)."""
  tile_k = min(cfg.tile_k, max(64, pl.next_power_of_2(k)))
  tile_n = min(cfg.tile_n, max(64, pl.next_power_of_2(n)))
  cfg = dataclasses.replace(cfg, tile_k=tile_k, tile_n=tile_n, epi_tile_n=min(cfg.epi_tile_n, tile_n))
  fits = lambda c: c.max_concurrent_steps * stage_bytes(c) + out_bytes(c) + 1024 <= _SMEM_BYTES
  while not fits(cfg) and cfg.epi_tile_n > 16:
    cfg = dataclasses.replace(cfg, epi_tile_n=cfg.epi_tile_n // 2)
  while not fits(cfg) and cfg.max_concurrent_steps > 2:
    cfg = dataclasses.replace(cfg, max_concurrent_steps=cfg.max_concurrent_steps - 1)
  # Last resort, for a config given by hand: shallower K steps, then narrower N tiles.
  while not fits(cfg) and cfg.tile_k > 64:
    cfg = dataclasses.replace(cfg, tile_k=cfg.tile_k // 2)
  while not fits(cfg) and cfg.tile_n > 64:
    cfg = dataclasses.replace(cfg, tile_n=cfg.tile_n // 2, epi_tile_n=min(cfg.epi_tile_n, cfg.tile_n // 2))
  if not fits(cfg):
    raise ValueError(f"no tiles of {cfg} fit the {_SMEM_BYTES} bytes of shared memory")
  return cfg


def _store_tile(accs, out_smem, out_refs, wg_idx, epi_tile_n, epilogue=None):
  """Write one consumer's accumulators to out_refs (their [rows, cols] windows) via smem + TMA,
  in epi_tile_n-wide pieces through out_smem's slots (its dim 1), so stores overlap the next pieces.

  epilogue(pieces, j) -> one array per out_ref, for the pieces acc[:, j*epi_tile_n:...] of each
  accumulator; None stores the pieces themselves. Working piece by piece keeps an epilogue's
  temporaries small.
  """
  slots = out_smem.shape[1]
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  slot = 0
  for j in range(accs[0].shape[1] // epi_tile_n):
    cols = slice(j * epi_tile_n, (j + 1) * epi_tile_n)
    pieces = tuple(acc[:, cols] for acc in accs)
    if epilogue is not None:
      pieces = epilogue(pieces, j)
    for piece, out_ref in zip(pieces, out_refs, strict=True):
      plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
      out_smem[wg_idx, slot] = piece.astype(out_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem.at[wg_idx, slot],
                              out_ref.at[:, pl.ds(j * epi_tile_n, epi_tile_n)])
      slot = (slot + 1) % slots


def _consumer_done(steps, tile_done):
  @pl.when(steps > 0)
  def _():
    plgpu.barrier_arrive(tile_done)


def _producer_waits_for_tile(wg_idx, steps, tile_done):
  """Hold the producer until both consumers have drained this tile's wgmmas.

  With delay_release, the pipeline never releases the slots of a tile's last steps (the
  consumers keep one wgmma in flight), so without this wait the next tile's prologue could
  overwrite a slot before a consumer has read it (the GPU interpreter reports it as a barrier
  completing twice unobserved). The consumers arrive once their accumulator is read, before
  their epilogue, so the next tile's loads still overlap the stores. Tiles of zero steps load
  nothing and skip the handshake (consumers could otherwise pass several of them, completing
  the barrier twice before the producer looks).
  """
  @pl.when((wg_idx == 2) & (steps > 0))
  def _():
    plgpu.barrier_wait(tile_done)


def _row_iota(shape):
  """Row index of each element of a wgmma-shaped register array."""
  iota = lax.broadcasted_iota(jnp.int32, shape, 0)
  # The layout is a hint for the compiler only; the CPU interpreter (jax 0.10) has no rule for it.
  return iota if _interpret() is not None else plgpu.layout_cast(iota, plgpu.Layout.WGMMA)


def _zero_rows_from(ref, first):
  """ref[first:] = 0 for a shared-memory tile the consumer reads next (a read-modify-write of
  ref, then a fence so the wgmma's async proxy sees it). A select, not a multiply by a 0/1 mask:
  the rows past `first` may hold anything a caller left there, NaN and inf included, and
  NaN * 0 is NaN."""
  ref[...] = jnp.where(_row_iota(ref.shape) < first, ref[...], jnp.zeros((), ref.dtype))
  plgpu.commit_smem()


def expert_band_order(
    row_block_expert: Int[Array, "row_blocks"],
    expert_block_offsets: Int[Array, "experts_plus_one"],
    n_iters: int,
    width: int,
) -> Int[Array, "tiles"]:
  """order[p] = m * n_iters + n: the p-th output tile (row block m, column tile n) of gmm's persistent
  loop. Each expert's row blocks are cut into bands of at most `width` (the blocks past the active
  ones are one more group, last); a band's tiles come together, m fastest, n ascending in a band of
  even index within its expert and descending in an odd one (a snake, as planar_snake's).

  planar_snake's bands of `width` blocks over all row blocks split every expert that straddles a
  band boundary: its weight tiles are then read once per band, from DRAM, since the band between
  has evicted them. At E64 top-1 (2.5 blocks an expert, bands of 8) Nsight Compute counted 655 MB of
  DRAM reads for x W_in against 554 MB of operands. Here the CTAs in flight share each weight tile
  within one band. A permutation of range(row_blocks * n_iters), built by one scatter.
  """
  num_blocks = row_block_expert.shape[0]
  b = jnp.arange(num_blocks, dtype=jnp.int32)
  active = expert_block_offsets[-1]
  e = row_block_expert
  first = jnp.where(b < active, expert_block_offsets[e], active)
  end = jnp.where(b < active, expert_block_offsets[e + 1], num_blocks)
  band = (b - first) // width
  start = first + band * width
  band_width = jnp.minimum(width, end - start)
  n = jnp.arange(n_iters, dtype=jnp.int32)[None, :]
  rank = jnp.where((band % 2 == 1)[:, None], n_iters - 1 - n, n)
  pos = start[:, None] * n_iters + rank * band_width[:, None] + (b - start)[:, None]
  code = b[:, None] * n_iters + n
  return jnp.zeros((num_blocks * n_iters,), jnp.int32).at[pos.reshape(-1)].set(
      code.reshape(-1), unique_indices=True)


def _tile_coords(lin, shape, cfg: Config):
  """(row tile, column tile) of the lin-th output tile in cfg's planar_snake order. A grid of one
  tile is (0, 0) outright: with every operand constant, XLA:CPU's constant folding of
  planar_snake's unused remainder branch divides by zero and kills the process (GPU interpret mode,
  e.g. tgmm with K <= 128 and N <= 2 * tile_n)."""
  if shape[0] * shape[1] == 1:
    return jnp.int32(0), jnp.int32(0)
  return plgpu.planar_snake(lin, shape, cfg.grid_minor_dim, cfg.grid_tile_width)


def _warp_specialized(body, grid, in_specs, cfg, compute_context):
  return plgpu.emit_pipeline_warp_specialized(
      body, grid=grid, memory_registers=40, in_specs=in_specs, wg_axis="wg",
      num_compute_wgs=2, max_concurrent_steps=cfg.max_concurrent_steps,
      compute_context=compute_context)


def gmm_kind(weights, pre, activation, transpose_rhs) -> str:
  """Which gmm kernel variant these arguments select: the Configs field of its config."""
  return ("gmm_dglu" if len(pre) == 2 else "gmm_dact" if pre else "gmm_glu" if len(weights) == 2
          else "gmm_t" if transpose_rhs else "gmm_act" if activation is not None else "gmm")


def _launch(body, out_shape, *args, name: str, num_threads=3):
  """The kernel, named `name` + "_mosaic_gpu_kernel" in profiles (Mosaic GPU names it after the
  body function): the gmm kernels would otherwise all read body_mosaic_gpu_kernel."""
  body.__name__ = f"sparsejax_{name}"
  return plgpu.kernel(
      body, out_type=out_shape, grid=(_num_sms(),), grid_names=("sm",), num_threads=num_threads,
      thread_name="wg",
      # approx_math: the exp and rsqrt of the activation epilogues (sparsejax.activations' kernel
      # forms) become one special-function instruction each; the epilogues were issue-bound.
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                           approx_math=True),
      interpret=_interpret(),
  )(*args)


# ----------------------------------------------------------------------------------------------
# gmm: out[r] = lhs[r] @ rhs[e(r)] (or rhs[e(r)]^T)
# ----------------------------------------------------------------------------------------------
def tail_split(active_tiles, num_sms: int, splits: tuple[int, ...]):
  """(split, main_end, tail) for a persistent loop over active_tiles equal tiles on num_sms SMs:
  the last, partial wave's tail = active_tiles % num_sms tiles are cut into `split` column pieces
  each (the largest s of splits with s * tail <= num_sms, else 1: one piece an SM at most, so the
  pieces run side by side); the main loop runs the tiles before main_end whole."""
  tail = lax.rem(active_tiles, num_sms)
  split = jnp.int32(1)
  for s in sorted(splits):
    split = jnp.where(s * tail <= num_sms, jnp.int32(s), split)
  return split, jnp.where(split > 1, active_tiles - tail, active_tiles), tail


def _gmm_padded(lhs, weights, row_block_expert, row_block_rows, pre=(), *, block_m, transpose_rhs,
                out_dtype, cfg: Config, activation=None, order=None, active=None):
  """The gmm kernel and its epilogue variants. weights: (W,), or (W_gate, W_in) for the GLU
  form (two accumulators per consumer over the same lhs tile); pre: the forward's products that
  a backward epilogue reads, each consumer's tile arriving by TMA while its K loop runs.

    weights    pre      writes
    W          ()       acc                                     (no activation)
    W          ()       acc, act(acc)                           x W_in
    Wg, Wi     ()       g, u, act(g) * u                        x W_gate, x W_in
    W          (p,)     acc * act'(p)                           dY W_out^T
    W          (g, u)   acc * u * act'(g), acc * act(g)         dY W_out^T

  order: expert_band_order's tile table, or None for planar_snake over all row blocks.
  active: [1] active row blocks, with order and cfg.split_tail: the last wave's tiles are cut
  into narrower column pieces that run side by side (tail_split), in a second loop with its own
  pipeline, after the main loop has left that wave out.
  """
  rows, k = lhs.shape
  n = weights[0].shape[1] if transpose_rhs else weights[0].shape[2]
  tile_n, tile_k = cfg.tile_n, cfg.tile_k
  delay = min(cfg.delay_release, cfg.max_concurrent_steps - 1)
  half = block_m // 2  # rows per consumer warpgroup: one wgmma M of 64
  m_iters, n_iters = rows // block_m, n // tile_n
  dtype = lhs.dtype
  num_w, num_pre = len(weights), len(pre)
  num_out = num_pre if num_pre else 3 if num_w == 2 else 2 if activation is not None else 1
  num_sms = _num_sms()
  splits = tuple(s for s in (2, 4) if tile_n // s >= 64) if active is not None else ()
  if active is not None and order is None:
    raise ValueError("the tail split walks expert_band_order's table: pass order with active")

  k_iters = k // tile_k

  def specs_of(width):
    a_spec = plgpu.BlockSpec((block_m, tile_k), lambda s: (0, s), transforms=_transforms(tile_k, dtype),
                             delay_release=delay)
    if transpose_rhs:
      b_spec = plgpu.BlockSpec((width, tile_k), lambda s: (0, s), transforms=_transforms(tile_k, dtype),
                               delay_release=delay)
    else:
      b_spec = plgpu.BlockSpec((tile_k, width), lambda s: (s, 0), transforms=_transforms(width, dtype),
                               delay_release=delay)
    return [a_spec] + [b_spec] * num_w

  window = lambda w, n_slice: w.at[n_slice, :] if transpose_rhs else w.at[:, n_slice]

  def body(*refs):
    order_gmem = refs[0] if order is not None else None
    refs = refs[order is not None:]
    active_gmem = refs[0] if active is not None else None
    rbe_gmem, rbr_gmem, lhs_gmem, *refs = refs[active is not None:]
    w_gmems, pre_gmems, out_gmems = refs[:num_w], refs[num_w:num_w + num_pre], refs[num_w + num_pre:]
    if splits:
      split, main_end, tail = tail_split(active_gmem[0] * n_iters, num_sms, splits)

    def run_tiles(width, count, coords):
      """One persistent loop of `count` items over the SMs, each an output tile of `width` columns
      from its own pipeline: coords(i) -> (row block, first column, whether it runs)."""
      specs = specs_of(width)
      epi_tile_n = min(cfg.epi_tile_n, width)
      scratch = {}
      if num_pre:
        # Each consumer's [64, width] tiles of the pre-activations, one barrier per copy.
        scratch = dict(pre_smem=plgpu.SMEM((2, num_pre, half, width), pre[0].dtype,
                                           transforms=_transforms(epi_tile_n, pre[0].dtype)),
                       pre_ready=plgpu.Barrier(num_arrivals=1, num_barriers=2 * num_pre))
      ignore = lambda *_, **__: None
      # The allocation's grid is static and as long as the ring, so the ring keeps all its slots
      # (a shorter static grid would shrink it below the dynamic pipeline's).
      allocs = _warp_specialized(ignore, (cfg.max_concurrent_steps,), specs, cfg,
                                 ignore).get_allocations(
          lhs_gmem.at[pl.ds(0, block_m), :], *[window(w.at[0], pl.ds(0, width)) for w in w_gmems])

      # Scopes in sequence share their shared memory: the tail's loop reuses the main loop's.
      @functools.partial(
          pl.run_scoped, pipeline_allocs=allocs,
          out_smem=plgpu.SMEM((2, cfg.epi_slots, half, epi_tile_n), out_dtype,
                              transforms=_transforms(epi_tile_n, out_dtype)),
          tile_done=plgpu.Barrier(num_arrivals=2), collective_axes="wg", **scratch)
      def _scope(pipeline_allocs, out_smem, tile_done, pre_smem=None, pre_ready=None):
        wg_idx = lax.axis_index("wg")

        @plgpu.nd_loop((count,), collective_axes="sm")
        def _tile(info):
          m_idx, col0, runs = coords(info.index[0])
          expert = rbe_gmem[m_idx]
          num_real = rbr_gmem[m_idx]
          # Inactive blocks (and items that do not run) take zero K steps and store nothing.
          steps = jnp.where((num_real > 0) & runs, k_iters, 0)
          m_slice = pl.ds(m_idx * block_m, block_m)
          n_slice = pl.ds(col0, width)
          wg_m = pl.ds(wg_idx * half, half)
          # A consumer whose 64 rows hold no token issues no wgmma: its zero accumulator is right.
          has_rows = (num_real > wg_idx * half) & (steps > 0)
          outs = [o.at[m_slice, n_slice].at[wg_m] for o in out_gmems]
          ready = lambda i: pre_ready.at[wg_idx * num_pre + i]
          pre_tile = lambda i, j: _load_wgmma(
              pre_smem.at[wg_idx, i, :, pl.ds(j * epi_tile_n, epi_tile_n)]).astype(jnp.float32)

          def compute_context(eval_pipeline):
            if num_pre:
              @pl.when(has_rows)
              def _():
                plgpu.commit_smem()  # the last tile's reads of pre_smem come before this TMA write
                for i, p in enumerate(pre_gmems):
                  plgpu.copy_gmem_to_smem(p.at[m_slice, n_slice].at[wg_m], pre_smem.at[wg_idx, i],
                                          ready(i))

            @functools.partial(pl.run_scoped, **{f"acc{i}": plgpu.ACC((half, width), jnp.float32)
                                                 for i in range(num_w)})
            def _acc(**acc_refs):
              accs = tuple(acc_refs[f"acc{i}"] for i in range(num_w))
              eval_pipeline(accs)
              real = _row_iota((half, width)) < num_real - wg_idx * half
              accs = tuple(jnp.where(real, a[...], 0.0) for a in accs)
              _consumer_done(steps, tile_done)
              piece_real = lambda j: real[:, j * epi_tile_n:(j + 1) * epi_tile_n]
              if num_pre:
                @pl.when(has_rows)
                def _():
                  for i in range(num_pre):
                    plgpu.barrier_wait(ready(i))

              # A consumer without rows never loaded pre_smem: the epilogue selects, so stale bits stay out.
              epilogue = gmm_epilogue(activation, num_w, num_pre, pre_tile, piece_real)
              # Nothing reads an inactive block's rows (every consumer gathers real rows, and the
              # kernels run zero steps on them), so they are left unwritten: under expert
              # parallelism about half the worst-case receive buffer is inactive.
              @pl.when(steps > 0)
              def _():
                _store_tile(accs, out_smem, outs, wg_idx, epi_tile_n, epilogue)

          def mma(_, a_smem, *refs):
            *b_smems, accs = refs

            @pl.when(has_rows)
            def _():
              for b_smem, acc_ref in zip(b_smems, accs, strict=True):
                b = b_smem.transpose((1, 0)) if transpose_rhs else b_smem
                plgpu.wgmma(acc_ref, a_smem.at[wg_m], b)

            plgpu.wgmma_wait(num_w * delay)  # each wgmma is one group: keep this step's in flight
            return accs

          _warp_specialized(mma, (steps,), specs, cfg, compute_context)(
              lhs_gmem.at[m_slice, :], *[window(w.at[expert], n_slice) for w in w_gmems],
              allocations=pipeline_allocs)
          _producer_waits_for_tile(wg_idx, steps, tile_done)

      # The stores read out_smem: done before a later scope takes its memory.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def ordered(i):  # (row block, column tile) of the order table's i-th tile
      code = order_gmem[i]
      return lax.div(code, jnp.int32(n_iters)), lax.rem(code, jnp.int32(n_iters))

    def main_coords(i):
      m_idx, n_idx = _tile_coords(i, (m_iters, n_iters), cfg) if order is None else ordered(i)
      return m_idx, n_idx * tile_n, (i < main_end) if splits else True

    run_tiles(tile_n, m_iters * n_iters, main_coords)
    for s in splits:
      def tail_coords(p, s=s):
        # Piece p % s of the tail's tile p // s (expert_band_order lists the active tiles first).
        m_idx, n_idx = ordered(jnp.minimum(main_end + p // s, m_iters * n_iters - 1))
        return m_idx, n_idx * tile_n + lax.rem(p, s) * (tile_n // s), (split == s) & (p < s * tail)

      run_tiles(tile_n // s, num_sms, tail_coords)

  out_shape = jax.ShapeDtypeStruct((rows, n), out_dtype)
  args = (row_block_expert, row_block_rows, lhs, *weights, *pre)
  if active is not None:
    args = (active,) + args
  if order is not None:
    args = (order,) + args
  return _launch(body, (out_shape,) * num_out if num_out > 1 else out_shape, *args,
                 name=gmm_kind(weights, pre, activation, transpose_rhs) + "_cooperative")


def gmm_epilogue(activation, num_w, num_pre, pre_tile, piece_real):
  """The epilogue(pieces, j) of _store_tile for a gmm variant (the table in _gmm_padded), or None
  for a plain product. pieces: the float32 accumulators' j-th epi_tile_n-wide pieces, zero on the
  rows without a token; pre_tile(i, j): pre[i]'s matching piece as float32; piece_real(j): the
  piece's mask of rows with a token (pre is whatever the caller passed on the others).
  activation: SaveDerivative(act) for gmm_act's (act'(pre), act(pre)); None for gmm_dact whose pre
  holds act'(pre) already (the product times it)."""
  if isinstance(activation, SaveDerivative):
    both = VALUE_AND_DERIVATIVE[activation.activation]

    def epilogue(pieces, j):
      h, d = both(pieces[0])  # h is zero on the zeroed padding rows; act'(0) need not be
      return jnp.where(piece_real(j), d, 0.0), h
    return epilogue
  fn = PLAIN.get(activation, activation)
  if num_pre == 1:
    derivative = (lambda p: p) if activation is None else DERIVATIVES[activation]

    def epilogue(pieces, j):
      d = pieces[0] * derivative(pre_tile(0, j))
      return (jnp.where(piece_real(j), d, 0.0),)
  elif num_pre == 2:
    def epilogue(pieces, j):
      g, u = pre_tile(0, j), pre_tile(1, j)
      dg = pieces[0] * u * DERIVATIVES[activation](g)
      du = pieces[0] * fn(g)
      return jnp.where(piece_real(j), dg, 0.0), jnp.where(piece_real(j), du, 0.0)
  elif num_w == 2:
    def epilogue(pieces, j):
      g, u = pieces
      return g, u, fn(g) * u  # u is zero past the real rows, and so is the product
  elif activation in PLAIN:  # each maps the zeroed padding rows to zero: no second select
    def epilogue(pieces, j):
      return pieces[0], fn(pieces[0])
  elif activation is not None:
    def epilogue(pieces, j):
      return pieces[0], jnp.where(piece_real(j), fn(pieces[0]), 0.0)
  else:
    epilogue = None
  return epilogue


# jax 0.10's plgpu.load takes the index as a required argument; jax 0.11 deprecates passing it (the ref comes
# indexed), so the index goes only where it is required.
_LOAD_NEEDS_INDEX = (getattr(inspect.signature(plgpu.load).parameters.get("idx"), "default", None)
                     is inspect.Parameter.empty)


def _load_wgmma(ref):
  """A shared-memory tile read into registers in the accumulator's (wgmma) layout."""
  if _interpret() is not None:
    return ref[...]
  if _LOAD_NEEDS_INDEX:
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)
  return plgpu.load(ref, layout=plgpu.Layout.WGMMA)


def _gmm_config(lhs, n, topo, cfg, out_dtype, num_w=1, pre=()):
  """cfg fitted to one gmm call; num_w weights share each lhs tile (GLU: 2); pre: the backward
  epilogue's extra tiles."""
  k = lhs.shape[1]
  size, out_size = jnp.dtype(lhs.dtype).itemsize, jnp.dtype(out_dtype).itemsize
  block_m = topo.block_size
  pre_bytes = lambda c: sum(block_m * c.tile_n * jnp.dtype(p.dtype).itemsize for p in pre)
  return _fit(cfg, k, n,
              stage_bytes=lambda c: (block_m + num_w * c.tile_n) * c.tile_k * size,
              out_bytes=lambda c: 2 * c.epi_slots * (block_m // 2) * c.epi_tile_n * out_size + pre_bytes(c))


def _call_shared(kernel, *args, dynamic=None, **static):
  """kernel(*args, **dynamic, **static), lowered and compiled once per program for all the call sites
  (the layers) that share its shapes and static arguments (shared_lowering.py says why); in interpret
  mode called directly. _num_sms() shapes the trace (tests patch it to lower for an H100)."""
  if _interpret() is not None:
    return kernel(*args, **(dynamic or {}), **static)
  return call_shared(kernel, *args, dynamic=dynamic, cache_key=_num_sms(), **static)


def _gmm_call(lhs, weights, topo, transpose_rhs, out_dtype, configs, activation=None, pre=()):
  """Fit the config of the kernel variant these arguments select, pad to its tiles, run, unpad."""
  n = weights[0].shape[1] if transpose_rhs else weights[0].shape[2]
  kind = gmm_kind(weights, pre, activation, transpose_rhs)
  base = _configs(configs).gmm_for(kind, lhs.shape[0], topo.num_experts)
  if base.pingpong and base.epilogue_wg:
    raise ValueError(f"Config.pingpong and Config.epilogue_wg are two schedules; {kind} got both")
  if base.epilogue_wg:
    from sparsejax.kernels.gmm import mosaic_epilogue

    if kind not in ("gmm_act", "gmm_dact"):
      raise ValueError(f"Config.epilogue_wg serves gmm_act and gmm_dact; got it for {kind}")
    if isinstance(activation, SaveDerivative) or activation is None:
      raise ValueError(f"Config.epilogue_wg's {kind} takes pre itself, not act'(pre) (saves_derivative "
                       f"says which form a config takes); got activation={activation}")
    cfg, n_buf = mosaic_epilogue.fit(base, lhs.shape[1], n, topo.block_size, len(pre))
    padded, static, dynamic = mosaic_epilogue.gmm_padded, dict(n_buf=n_buf), {}
  else:
    if base.pingpong:
      from sparsejax.kernels.gmm import mosaic_pingpong

      cfg = mosaic_pingpong.fit_gmm(base, lhs.shape[1], n, topo.block_size, len(pre), lhs.dtype, out_dtype,
                                    num_w=len(weights))
      padded = mosaic_pingpong.gmm_padded
    else:
      cfg = _gmm_config(lhs, n, topo, base, out_dtype, len(weights), pre)
      padded = _gmm_padded
    static, dynamic = {}, {}
    if cfg.split_tail:
      if padded is not _gmm_padded or not cfg.expert_bands:
        raise ValueError(f"Config.split_tail serves the cooperative kernel in expert_band_order "
                         f"(expert_bands=True, pingpong=False); {kind} got {cfg}")
      dynamic["active"] = topo.num_active_blocks
    if cfg.expert_bands:
      if cfg.grid_minor_dim != M_DIM:
        raise ValueError(f"Config.expert_bands orders row blocks within column tiles: it needs "
                         f"grid_minor_dim=M_DIM; got {cfg.grid_minor_dim} for {kind}")
      n_iters = -(-n // cfg.tile_n)
      dynamic["order"] = expert_band_order(
          topo.row_block_expert, topo.expert_block_offsets, n_iters, cfg.grid_tile_width)
  lhs_p = pad_to(lhs, 1, cfg.tile_k)
  if transpose_rhs:
    weights = tuple(pad_to(pad_to(w, 1, cfg.tile_n), 2, cfg.tile_k) for w in weights)
  else:
    weights = tuple(pad_to(pad_to(w, 1, cfg.tile_k), 2, cfg.tile_n) for w in weights)
  pre = tuple(pad_to(p, 1, cfg.tile_n) for p in pre)
  out = _call_shared(padded, lhs_p, weights, topo.row_block_expert, topo.row_block_rows, pre,
                     dynamic=dynamic, block_m=topo.block_size, transpose_rhs=transpose_rhs,
                     out_dtype=jnp.dtype(out_dtype), cfg=cfg, activation=activation, **static)
  unpad = lambda o: o if o.shape[1] == n else o[:, :n]
  return tuple(map(unpad, out)) if isinstance(out, tuple) else unpad(out)


def gmm(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "experts k n"] | Float[Array, "experts n k"],
    topo: Topology,
    transpose_rhs: bool,
    out_dtype,
    configs: Configs | None = None,
) -> Float[Array, "rows n"]:
  """out[r] = lhs[r] @ rhs[e(r)] (rhs[e(r)]^T with transpose_rhs) for real rows r; zero on the
  other rows of active blocks, unwritten in inactive blocks (op.py)."""
  if lhs.dtype == jnp.float32:
    from sparsejax.kernels.gmm import triton
    return triton.gmm(lhs, rhs, topo, transpose_rhs, out_dtype)
  return _gmm_call(lhs, (rhs,), topo, transpose_rhs, out_dtype, configs)


def gmm_act(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "experts k n"],
    topo: Topology,
    activation,
    configs: Configs | None = None,
) -> tuple[Float[Array, "rows n"], Float[Array, "rows n"]]:
  """(pre, act(pre)) with pre[r] = lhs[r] @ rhs[e(r)]: one kernel, the activation applied to the
  float32 accumulator in the epilogue (no separate pass over pre). Both zero on the other rows of
  active blocks. bf16 operands only (the caller routes float32 to the unfused path).
  activation=SaveDerivative(act): (act'(pre), act(pre)) instead, for a backward that needs pre only
  through act'(pre) (gmm_dact with activation=None); where saves_derivative allows."""
  return _gmm_call(lhs, (rhs,), topo, False, lhs.dtype, configs, activation=activation)


def saves_derivative(activation, rows: int, num_experts: int, configs: Configs | None = None) -> bool:
  """Whether gmm_act and gmm_dact at this size can pass act'(pre) between them instead of pre
  (SaveDerivative): the activation has a one-sigmoid VALUE_AND_DERIVATIVE form and neither kernel's
  config is the epilogue warpgroup's (which applies act or act' to pre itself). The backward then
  multiplies where it evaluated act'(pre) (exp and rsqrt an element): the expert MLP 0.5-1% less
  time and energy on an H100, none lost anywhere (results/mlp_saved_derivative_ab_H100.log)."""
  cfgs = _configs(configs)
  return activation in VALUE_AND_DERIVATIVE and not any(
      cfgs.gmm_for(kind, rows, num_experts).epilogue_wg for kind in ("gmm_act", "gmm_dact"))


def gmm_dact(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "experts n k"],
    topo: Topology,
    pre: Float[Array, "rows n"],
    activation,
    configs: Configs | None = None,
) -> Float[Array, "rows n"]:
  """(lhs[r] @ rhs[e(r)]^T) * act'(pre[r]): dH = dY W_out^T times the activation's derivative, in
  one kernel (each consumer's pre tile arrives by TMA while its K loop runs). activation: a key
  of sparsejax.activations.DERIVATIVES, or None when pre holds act'(pre) (gmm_act with
  SaveDerivative): then the product times pre."""
  return _gmm_call(lhs, (rhs,), topo, True, lhs.dtype, configs, activation=activation, pre=(pre,))


def gmm_glu(
    lhs: Float[Array, "rows k"],
    w_gate: Float[Array, "experts k n"],
    w_in: Float[Array, "experts k n"],
    topo: Topology,
    activation,
    configs: Configs | None = None,
) -> tuple[Float[Array, "rows n"], Float[Array, "rows n"], Float[Array, "rows n"]]:
  """(g, u, act(g) * u) with g[r] = lhs[r] @ w_gate[e(r)], u[r] = lhs[r] @ w_in[e(r)]: one kernel,
  two accumulators per consumer over each lhs tile, the GLU product taken in float32 in the
  epilogue. All zero on the other rows of active blocks. bf16 operands only."""
  return _gmm_call(lhs, (w_gate, w_in), topo, False, lhs.dtype, configs, activation=activation)


def gmm_dglu(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "experts n k"],
    topo: Topology,
    gate: Float[Array, "rows n"],
    up: Float[Array, "rows n"],
    activation,
    configs: Configs | None = None,
) -> tuple[Float[Array, "rows n"], Float[Array, "rows n"]]:
  """(dg, du) = (dh * u * act'(g), dh * act(g)) with dh[r] = lhs[r] @ rhs[e(r)]^T: the GLU's
  backward through dH = dY W_out^T, in one kernel (g and u tiles arrive by TMA during the K
  loop). activation: a key of sparsejax.activations.DERIVATIVES."""
  return _gmm_call(lhs, (rhs,), topo, True, lhs.dtype, configs, activation=activation,
                   pre=(gate, up))


# ----------------------------------------------------------------------------------------------
# tgmm: out[e] = sum over row blocks r of expert e of lhs[r]^T @ dout[r]
# ----------------------------------------------------------------------------------------------
# A tgmm tile reduces over all of its expert's rows, so its cost grows with the expert's load,
# and the persistent loop hands step i to SM i % num_sms. In expert order, the 32 tiles of a busy
# expert land on 32 neighbouring SMs and the others wait for them: with the busiest expert at
# 7.6x the mean load, tgmm ran 1.39x its uniform-routing time on an H100 (25.6x: 2.04x;
# experiments/results/gmm_skew_*). Training routing is that skewed at first and stays at 2-8x
# (MoE-XS, 45 s run). Sorting the experts heaviest first and reversing every second wave of
# num_sms steps (boustrophedon) gives the SM that took a wave's heaviest tile the next wave's
# lightest, list scheduling's heaviest-first order within what a static loop allows.

def heaviest_first(offsets: Int[Array, "experts_plus_one"]) -> Int[Array, "experts"]:
  """order[p] = the expert with the p-th most row blocks (offsets[e+1] - offsets[e]), ties by index.

  Comparisons, not a sort: [E, E] elementwise work that XLA fuses into one small kernel."""
  load = offsets[1:] - offsets[:-1]
  e = jnp.arange(load.shape[0], dtype=jnp.int32)
  ahead = (load[None, :] > load[:, None]) | ((load[None, :] == load[:, None]) & (e[None, :] < e[:, None]))
  place = jnp.sum(ahead, axis=1, dtype=jnp.int32)  # place[e]: experts ahead of e
  return jnp.sum(jnp.where(place[None, :] == e[:, None], e[None, :], 0), axis=1, dtype=jnp.int32)


def _tgmm_item(step, total, width):
  """The item that the step-th step of a persistent loop over `total` items on `width` SMs works
  on (step runs on SM step % width): the identity, except that every second full wave of `width`
  steps runs backwards. A permutation of range(total)."""
  wave, pos = step // width, step % width
  backwards = (wave % 2 == 1) & ((wave + 1) * width <= total)
  return jnp.where(backwards, wave * width + (width - 1 - pos), step)


def tgmm_plan(order: Int[Array, "experts"], offsets: Int[Array, "experts_plus_one"],
              row_block_rows: Int[Array, "row_blocks"], *, block_m: int, tile_k: int) -> Int[Array, "experts 4"]:
  """plan[p] = (e, steps, tail, row0) of e = order[p]: its real rows' reduction steps of tile_k rows (zero for no
  rows), the real rows in the last step, and its first step's index (first row block x steps a block).

  One row a tile's metadata, so a tgmm tile reads it in one round trip (four independent loads) where reading
  order, then offsets, then the last block's rows in the kernel was three dependent ones."""
  first, end = offsets[order], offsets[order + 1]
  # Real rows of the expert: full blocks, then its last block's real rows.
  last_rows = jnp.where(end > first, row_block_rows[jnp.maximum(end - 1, 0)], 0)
  num_rows = jnp.maximum(end - first - 1, 0) * block_m + last_rows
  steps = (num_rows + tile_k - 1) // tile_k
  tail = num_rows - (steps - 1) * tile_k
  return jnp.stack([order, steps, tail, first * (block_m // tile_k)], axis=1).astype(jnp.int32)


def _tgmm_tile(step, plan_gmem, *, grid, num_sms, cfg: Config):
  """(expert, row tile, column tile, reduction steps, real rows in the last step, first step's row
  block x steps a block) of the step-th step of tgmm's persistent loop over experts x grid tiles:
  experts in the plan's order (heaviest first), every second full wave backwards (_tgmm_item)."""
  tiles = grid[0] * grid[1]
  num_experts = plan_gmem.shape[0]
  item = _tgmm_item(step, num_experts * tiles, num_sms) if cfg.balance_experts else step
  p = item // tiles
  m_idx, n_idx = _tile_coords(item % tiles, grid, cfg)
  return plan_gmem[p, 0], m_idx, n_idx, plan_gmem[p, 1], plan_gmem[p, 2], plan_gmem[p, 3]


def _tgmm_padded(lhs, dout, plan, *, block_m, out_dtype, cfg: Config):
  rows, k = lhs.shape
  n = dout.shape[1]
  num_experts = plan.shape[0]
  # Output tiles are [block_m of K] x [2 * tile_n of N]; the reduction runs over an expert's real
  # rows, tile_r at a time (tile_r divides the 128-row block, so a step never leaves the expert).
  tile_m, tile_n, tile_r, epi_tile_n = block_m, cfg.tile_n, cfg.tile_k, cfg.epi_tile_n
  cta_n = 2 * tile_n
  m_iters, n_iters = k // tile_m, n // cta_n
  delay = min(cfg.delay_release, cfg.max_concurrent_steps - 1)
  dtype = lhs.dtype
  a_tf, b_tf = _transforms(tile_m, dtype), _transforms(cta_n, dtype)
  a_spec = plgpu.BlockSpec((tile_r, tile_m), lambda s: (s, 0), transforms=a_tf, delay_release=delay)
  b_spec = plgpu.BlockSpec((tile_r, cta_n), lambda s: (s, 0), transforms=b_tf, delay_release=delay)
  out_transforms = _transforms(epi_tile_n, out_dtype)

  tiles = m_iters * n_iters
  num_sms = _num_sms()

  def body(plan_gmem, lhs_gmem, dout_gmem, out_gmem):
    ignore = lambda *_, **__: None
    allocs = _warp_specialized(ignore, (cfg.max_concurrent_steps,), [a_spec, b_spec], cfg,
                               ignore).get_allocations(
        lhs_gmem.at[:, pl.ds(0, tile_m)], dout_gmem.at[:, pl.ds(0, cta_n)])

    @functools.partial(
        pl.run_scoped, pipeline_allocs=allocs,
        out_smem=plgpu.SMEM((2, 2, tile_m, epi_tile_n), out_dtype, transforms=out_transforms),
        tile_done=plgpu.Barrier(num_arrivals=2), collective_axes="wg")
    def _scope(pipeline_allocs, out_smem, tile_done):
      wg_idx = lax.axis_index("wg")

      # Experts major (in `order`): the CTAs in flight work on a few experts' rows, which stay in L2.
      @plgpu.nd_loop((num_experts * tiles,), collective_axes="sm")
      def _tile(info):
        e, m_idx, n_idx, steps, tail, row0 = _tgmm_tile(info.index[0], plan_gmem, grid=(m_iters, n_iters),
                                                        num_sms=num_sms, cfg=cfg)
        m_slice = pl.ds(m_idx * tile_m, tile_m)
        n_slice = pl.ds(n_idx * cta_n, cta_n)
        wg_n = pl.ds(wg_idx * tile_n, tile_n)

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def _acc(acc_ref):
            eval_pipeline(acc_ref)
            acc = acc_ref[...]
            _consumer_done(steps, tile_done)
            _store_tile((acc,), out_smem, [out_gmem.at[e, m_slice, n_slice].at[:, wg_n]], wg_idx,
                        epi_tile_n)

        def mma(idx, a_smem, b_smem, acc_ref):
          b = b_smem.at[:, wg_n]

          # The last step may reach into padding rows: zero them in this consumer's own columns.
          @pl.when((idx[0] == steps - 1) & (tail < tile_r))
          def _():
            _zero_rows_from(b, tail)

          plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)), b)
          plgpu.wgmma_wait(delay)
          return acc_ref

        specs = [
            plgpu.BlockSpec((tile_r, tile_m), lambda s: (row0 + s, 0), transforms=a_tf,
                            delay_release=delay),
            plgpu.BlockSpec((tile_r, cta_n), lambda s: (row0 + s, 0), transforms=b_tf,
                            delay_release=delay),
        ]
        _warp_specialized(mma, (steps,), specs, cfg, compute_context)(
            lhs_gmem.at[:, m_slice], dout_gmem.at[:, n_slice], allocations=pipeline_allocs)
        _producer_waits_for_tile(wg_idx, steps, tile_done)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return _launch(body, jax.ShapeDtypeStruct((num_experts, k, n), out_dtype),
                 plan, lhs, dout, name="tgmm_per_tile")


def observe_last_releases(consumed_at, total, slots):
  """Wait on the release barrier of each of a ring's last `slots` steps (of `total`), so that no
  barrier ends the kernel with an unobserved phase. consumed_at(step): that step's barrier."""
  @pl.loop(jnp.maximum(total - slots, 0), total)
  def _observe(step):
    plgpu.barrier_wait(consumed_at(step))


def _claim_slot(consumed, step, slots):
  """The slot of a TMA ring's step-th load, once that slot's previous step (step - slots) has been
  released on consumed[slot]."""
  slot = lax.rem(step, slots)

  @pl.when(step >= slots)
  def _():
    plgpu.barrier_wait(consumed.at[slot])

  return slot


def issue_tgmm_tile(lhs_gmem, dout_gmem, a_smem, b_smem, consumed, ready, *, m_idx, n_idx, row0, step0,
                    steps, tile_r, tile_m, tile_n):
  """The producer's loads of one tgmm tile (lhs columns m_idx, dout columns n_idx, each tile_m /
  tile_n wide) into a hand-written TMA ring (_tgmm_streamed, mosaic_pingpong.tgmm_padded): step s
  reads tile_r rows from row tile row0 + s into slot (step0 + s) % slots, both copies signalling
  ready(slot)."""
  cols_a, cols_b = pl.ds(m_idx * tile_m, tile_m), pl.ds(n_idx * tile_n, tile_n)

  @pl.loop(0, steps)
  def _step(s):
    slot = _claim_slot(consumed, step0 + s, a_smem.shape[0])
    rows = pl.ds((row0 + s) * tile_r, tile_r)
    plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, cols_a], a_smem.at[slot], ready(slot))
    plgpu.copy_gmem_to_smem(dout_gmem.at[rows, cols_b], b_smem.at[slot], ready(slot))


def issue_gmm_tile(lhs_gmem, w_es, a_smem, b_smems, consumed, ready, *, m_idx, n_idx, step0, steps,
                   block_m, tile_n, tile_k, transpose_rhs):
  """The producer's loads of one gmm tile (row block m_idx, column tile n_idx) into a hand-written
  TMA ring (mosaic_epilogue.py, mosaic_pingpong.py): step s of the tile is the ring's step0 + s, in
  slot (step0 + s) % slots, loaded once that slot's previous step is released on consumed[slot];
  ready(slot) is the barrier its copies (A, then each weight's B) signal. w_es: the expert's
  weights (W; or W_gate, W_in), b_smems their rings' B tiles."""
  rows, cols = pl.ds(m_idx * block_m, block_m), pl.ds(n_idx * tile_n, tile_n)

  @pl.loop(0, steps)
  def _step(s):
    slot = _claim_slot(consumed, step0 + s, a_smem.shape[0])
    ks = pl.ds(s * tile_k, tile_k)
    plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, ks], a_smem.at[slot], ready(slot))
    for w_e, b_smem in zip(w_es, b_smems, strict=True):
      plgpu.copy_gmem_to_smem(w_e.at[cols, ks] if transpose_rhs else w_e.at[ks, cols], b_smem.at[slot],
                              ready(slot))


# Registers per thread of the hand-written three-warpgroup kernels (_tgmm_streamed and
# mosaic_pingpong.py; 64 K a CTA, 512 a thread summed over the warpgroups): the producer only
# issues copies; each consumer holds a [128, tile_n] float32 accumulator (128 registers at tile_n
# 128) plus an epilogue piece. CUTLASS's warp-specialized kernels split the same way.
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232


def _tgmm_streamed(lhs, dout, plan, *, block_m, out_dtype, cfg: Config):
  """_tgmm_padded's tiles, items and numerics, on one ring for all of a CTA's items.

  The per-tile pipeline of _tgmm_padded starts each tile's loads only once both consumers have
  drained the last tile's wgmmas (_producer_waits_for_tile), so every tile begins with the
  latency of its first load, and an expert of 256 rows has only 4 reduction steps to hide it
  behind. Here the producer streams every step of every item through one ring and waits only for
  a slot's release: the next tile's rows arrive while the consumers run this tile's last steps
  and its epilogue. With epi_slots * epi_tile_n = tile_n a consumer stages its whole tile for
  the TMA stores, so the stores drain during the next tile's steps rather than in its epilogue.
  """
  rows, k = lhs.shape
  n = dout.shape[1]
  num_experts = plan.shape[0]
  tile_m, tile_n, tile_r, epi_tile_n = block_m, cfg.tile_n, cfg.tile_k, cfg.epi_tile_n
  cta_n = 2 * tile_n
  grid = (k // tile_m, n // cta_n)
  slots = cfg.max_concurrent_steps
  dtype = lhs.dtype
  items = (num_experts * grid[0] * grid[1],)
  num_sms = _num_sms()

  def body(plan_gmem, lhs_gmem, dout_gmem, out_gmem):
    scratch = dict(
        a_smem=plgpu.SMEM((slots, tile_r, tile_m), dtype, transforms=_transforms(tile_m, dtype)),
        b_smem=plgpu.SMEM((slots, tile_r, cta_n), dtype, transforms=_transforms(cta_n, dtype)),
        full=plgpu.Barrier(num_arrivals=2, num_barriers=slots),  # the A and B copies of a slot
        consumed=plgpu.Barrier(num_arrivals=2, num_barriers=slots),  # both consumers
        out_smem=plgpu.SMEM((2, cfg.epi_slots, tile_m, epi_tile_n), out_dtype,
                            transforms=_transforms(epi_tile_n, out_dtype)))

    @functools.partial(pl.run_scoped, collective_axes="wg", **scratch)
    def _scope(a_smem, b_smem, full, consumed, out_smem):
      wg_idx = lax.axis_index("wg")
      tile = lambda step: _tgmm_tile(step, plan_gmem, grid=grid, num_sms=num_sms, cfg=cfg)

      @pl.when(wg_idx == 2)
      def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        @plgpu.nd_loop(items, collective_axes="sm", init_carry=(jnp.int32(0),))
        def issued(info, carry):
          (step0,) = carry
          _, m_idx, n_idx, steps, _, row0 = tile(info.index[0])
          issue_tgmm_tile(lhs_gmem, dout_gmem, a_smem, b_smem, consumed, lambda slot: full.at[slot],
                          m_idx=m_idx, n_idx=n_idx, row0=row0, step0=step0, steps=steps, tile_r=tile_r,
                          tile_m=tile_m, tile_n=cta_n)
          return (step0 + steps,)

        observe_last_releases(lambda step: consumed.at[lax.rem(step, slots)], issued[0], slots)

      @pl.when(wg_idx < 2)
      def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        wg_n = pl.ds(wg_idx * tile_n, tile_n)

        @plgpu.nd_loop(items, collective_axes="sm", init_carry=(jnp.int32(0),))
        def _done(info, carry):
          (step0,) = carry
          e, m_idx, n_idx, steps, tail, _ = tile(info.index[0])

          # An expert with no rows runs zero steps: its gradient is the zero accumulator.
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def _acc(acc_ref):
            def k_step(s, acc):
              slot = lax.rem(step0 + s, slots)
              plgpu.barrier_wait(full.at[slot])
              b = b_smem.at[slot].at[:, wg_n]

              @pl.when((s == steps - 1) & (tail < tile_r))
              def _():
                _zero_rows_from(b, tail)

              plgpu.wgmma(acc, a_smem.at[slot].transpose((1, 0)), b)
              plgpu.wgmma_wait(1)  # the previous step's wgmma is done: release its slot

              @pl.when(s > 0)
              def _():
                plgpu.barrier_arrive(consumed.at[lax.rem(step0 + s - 1, slots)])
              return acc

            acc = lax.fori_loop(0, steps, k_step, acc_ref)
            plgpu.wgmma_wait(0)

            @pl.when(steps > 0)
            def _():
              plgpu.barrier_arrive(consumed.at[lax.rem(step0 + steps - 1, slots)])

            out = out_gmem.at[e, pl.ds(m_idx * tile_m, tile_m), pl.ds(n_idx * cta_n, cta_n)]
            _store_tile((acc[...],), out_smem, [out.at[:, wg_n]], wg_idx, epi_tile_n)

          return (step0 + steps,)

        plgpu.wait_smem_to_gmem(0)

  return _launch(body, jax.ShapeDtypeStruct((num_experts, k, n), out_dtype),
                 plan, lhs, dout, name="tgmm_streamed")


def tgmm(
    lhs: Float[Array, "rows k"],
    dout: Float[Array, "rows n"],
    topo: Topology,
    out_dtype,
    configs: Configs | None = None,
) -> Float[Array, "experts k n"]:
  """out[e] = lhs[real rows of e]^T @ dout[real rows of e]: the weight gradient (MegaBlocks' DS^T D)."""
  if lhs.dtype == jnp.float32:
    from sparsejax.kernels.gmm import triton
    return triton.tgmm(lhs, dout, topo, out_dtype)
  configs = _configs(configs)
  k, n = lhs.shape[1], dout.shape[1]
  size, out_size = jnp.dtype(lhs.dtype).itemsize, jnp.dtype(out_dtype).itemsize
  block_m = topo.block_size
  cfg = configs.tgmm_for(lhs.shape[0], topo.num_experts)
  if cfg.pingpong:
    from sparsejax.kernels.gmm import mosaic_pingpong

    cfg = mosaic_pingpong.fit(cfg, n, block_m, lhs.dtype, out_dtype)
    padded, cta_n = mosaic_pingpong.tgmm_padded, cfg.tile_n
  else:
    cfg = _fit(cfg, block_m, n,
               stage_bytes=lambda c: (block_m + 2 * c.tile_n) * c.tile_k * size,
               out_bytes=lambda c: 2 * (c.epi_slots if c.streamed else 2) * block_m * c.epi_tile_n * out_size)
    padded, cta_n = (_tgmm_streamed if cfg.streamed else _tgmm_padded), 2 * cfg.tile_n
  lhs_p, dout_p = pad_to(lhs, 1, block_m), pad_to(dout, 1, cta_n)
  offsets = topo.expert_block_offsets
  order = (heaviest_first(offsets) if cfg.balance_experts
           else jnp.arange(topo.num_experts, dtype=jnp.int32))
  plan = tgmm_plan(order, offsets, topo.row_block_rows, block_m=block_m, tile_k=cfg.tile_k)
  out = _call_shared(padded, lhs_p, dout_p, plan, block_m=block_m, out_dtype=jnp.dtype(out_dtype), cfg=cfg)
  return out if out.shape[1:] == (k, n) else out[:, :k, :n]
