"""skinny_matmul as a Pallas Triton kernel: split-K partial products that read each weight byte once.

At decode time a product has m <= 64 rows against a weight of megabytes: it is bound by the bytes of
the weight, and XLA's own lowering of an m = 1 dot (a broadcast multiply then a reduce, the product
written out in between) moves them at a third of the card's bandwidth. Here program (s, j, p) reads
the [rows, block_n] slab p of column block j of the slot's expert w[experts[s]] once and writes the
float32 partial x[s][:, slab] @ slab; the caller sums the partials (XLA fuses that sum into whatever
consumes it). Many small programs (the K dimension split into slabs) keep every SM loading.

What a program multiplies, its rows of x, comes from one of three sources: x as given, x RMS-normalized
(Normed: the norm's per-row factor applied after the loop), or the hidden layer of a feed-forward
(Hidden: act(sum of the first product's partials) [* the gate's], rounded to x's dtype), so that
neither the norm nor the first product's sum and activation runs as a kernel of its own. Where a program takes all
of K (one split) it may instead finish as that hidden layer itself (Activated: scaled, activated, in x's dtype).
int8 weights come k-major ([.., n, k], k_major): a program reads the same slab, each column's K rows contiguous.
Reference: reference.py. Off the GPU the kernel runs in Pallas' interpret mode (tests).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, Num

from sparsejax import kernels  # read when called, so the GPU's generation can be set in a test
from sparsejax._precision import dot_precision
from sparsejax.kernels import launch_dependents, whole_row
from sparsejax.kernels.shared_lowering import shared_lowering
from sparsejax.kernels.skinny_matmul.reference import k_major, kn


@dataclasses.dataclass(frozen=True)
class Config:
  """block_n output columns and rows_per_program K rows per program, read block_k rows at a time;
  use_dot: tensor-core dot on rows padded to >= 16 (else a float32 multiply-reduce, for one row)."""
  block_n: int
  block_k: int
  rows_per_program: int
  use_dot: bool
  num_warps: int = 4
  num_stages: int = 3


# int8 weights reach a multiply-reduce (one row, and the row FFN) through float bits, not a cast (an A-B switch
# shared_lowering keys on); the dot form casts, which ran 5-13% faster on k-major int8 at 32 rows
# (experiments/results/int8_weight_layout_H200_first_form.log).
INT8_FLOAT_BITS = True
_MAGIC_BITS = 0x4B000080  # float32 bits of 2^23 + 128: adding an int8 v gives the bits of 2^23 + 128 + v
_MAGIC = 8388736.0  # 2^23 + 128


def weights_as(ws, dtype, float_bits: bool = True):
  """ws in dtype, exactly. int8 by float bits: v + bits(2^23 + 128) are the float32 bits of 2^23 + 128 + v, so a
  float32 subtract gives v, and bf16 takes its top 16 bits (v has at most 8 significant ones). Triton compiles a
  cast without conversion instructions too (byte permutes and a bf16 add). On n-major int8 this form ran the
  one-row multiply-reduce 11% faster and the 32-row dot 3% (experiments/notes_decode.md, forty-third session);
  on k-major int8 the dot ran faster by a cast, which the kernel now uses there."""
  if not (INT8_FLOAT_BITS and float_bits) or ws.dtype != jnp.int8:
    return ws.astype(dtype)
  f = jax.lax.bitcast_convert_type(ws.astype(jnp.int32) + _MAGIC_BITS, jnp.float32) - _MAGIC
  if dtype != jnp.bfloat16:
    return f.astype(dtype)
  top = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(f, jnp.int32), 16).astype(jnp.int16)
  return jax.lax.bitcast_convert_type(top, jnp.bfloat16)


def _largest_dividing(n: int, candidates) -> int | None:
  return next((c for c in candidates if n % c == 0), None)


# Tiles of the dot form for more rows through several experts, most weight a program first:
# (block_n, rows_per_program), taken when they leave at least about a wave of programs (the H100 has 132
# SMs). From the m = 32 sweeps on an H100 (experiments/results/skinny_matmul_sweep_H100_m32*.json):
# through 22 experts, 128 columns by 1,024 (W_in) or 2,048 (W_out) K rows beat the 64 by 256-512 tiles by
# 15-24% (bf16) and 30-35% (int8). Through one weight the sweep's best tiles moved too (-6 to -9% on two of four
# shapes), but medium-dense's batch-32 step did not get faster (A-B-A-B 1.407 / 1.423 against 1.495 /
# 1.415 ms; experiments/notes_decode.md), so one weight keeps its tiles.
_WIDE_TILES = ((128, 2048), (128, 1024), (64, 512))
_MIN_WIDE_PROGRAMS = 128


def default_config(m: int, k: int, n: int, slots: int = 1) -> Config | None:
  """Tiles picked from H100 sweeps (experiments/results/skinny_matmul_sweep_H100*.json). One row: 64
  columns, 128 K rows a program for K <= 2048, else a dot over 512 rows. More rows (the dot form)
  through several experts: the widest of _WIDE_TILES that leaves slots x (n / block_n) x (k / rows) >=
  _MIN_WIDE_PROGRAMS programs; else 64 columns by 256 (512 for K >= 2048) rows. Then fit_shared_memory on
  this GPU. None when k or n is not a multiple of 16 (the caller then uses the reference)."""
  cfg = _tiles(m, k, n, slots)
  return None if cfg is None else fit_shared_memory(cfg, m, kernels.shared_memory_limit())


def _tiles(m: int, k: int, n: int, slots: int = 1) -> Config | None:
  """default_config's tiles, before the shared-memory fit."""
  block_n = _largest_dividing(n, (64, 32, 16))
  block_k = _largest_dividing(k, (128, 64, 32, 16))
  if block_n is None or block_k is None:
    return None
  use_dot = not (m == 1 and k <= 2048)
  if m > 1 and slots > 1:
    for bn, rows in _WIDE_TILES:
      if n % bn == 0 and k % rows == 0 and slots * (n // bn) * (k // rows) >= _MIN_WIDE_PROGRAMS:
        return Config(block_n=bn, block_k=128, rows_per_program=rows, use_dot=True)
  target = 128 if not use_dot else (512 if k >= 2048 else 256)
  rows = max(r for r in range(block_k, max(target, block_k) + 1, block_k) if k % r == 0)
  return Config(block_n=block_n, block_k=block_k, rows_per_program=rows, use_dot=use_dot)


def pipeline_bytes(cfg: Config, m: int) -> int:
  """Shared memory of the K loop's pipeline: num_stages buffers of x's [padded rows, block_k] slab and W's
  [block_k, block_n] tile, both counted as bf16 (int8 weights take half). The wide tile at 64 rows: 144 KiB."""
  return cfg.num_stages * (padded_rows(m, cfg.use_dot) + cfg.block_n) * cfg.block_k * 2


def fit_shared_memory(cfg: Config, m: int, limit: int | None) -> Config:
  """cfg with pipeline stages dropped (to one) until pipeline_bytes fits `limit` bytes (None: no limit). On Hopper
  and the A100 every tile fits as it is; the 99 KiB of sm_86 / sm_89 / sm_120 cards take two stages for the wide
  tiles (108-144 KiB at 16-64 padded rows)."""
  while limit is not None and cfg.num_stages > 1 and pipeline_bytes(cfg, m) > limit:
    cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
  return cfg


def padded_rows(m: int, use_dot: bool) -> int:
  """Rows the kernel computes: Triton's dot wants >= 16 and every block a power of two."""
  return max(16, pl.next_power_of_2(m)) if use_dot else 1


def norm_fits(m: int, k: int) -> bool:
  """Whether the kernel folds an RMSNorm of x's rows into the product: every program loads the whole
  (padded) rows, k padded to a power of two (whole_row), so only where they are at most 4,096 numbers. At 32
  rows of 512 (xs-moe at batch 32) the programs' copies of x made the step 18% slower on an H100
  (experiments/notes_decode.md); at one row of 1,024 folding took 9% off medium-moe's step."""
  return padded_rows(m, m > 1 or k > 2048) * whole_row.width(k) <= 4096


def hidden_fits(parts_rows: int, splits: int, m: int, k: int, n: int, slots: int = 1) -> bool:
  """Whether the kernel takes x as Hidden (the first product's [splits, parts_rows, k] partials): each
  program loads splits x parts_rows x rows_per_program float32 numbers of them, allowed up to 4,096
  (one row against medium-moe's 8 x 512); the parts come with one row or the kernel's own padded rows."""
  cfg = default_config(m, k, n, slots)
  if cfg is None:
    return False
  return parts_rows in (1, padded_rows(m, cfg.use_dot)) and splits * parts_rows * cfg.rows_per_program <= 4096


@dataclasses.dataclass(frozen=True)
class Plain:
  """x [m, k] shared by every slot, or x [slots, m, k]."""
  per_slot: bool
  operands = 1

  def slab(self, refs, s, expert, ks, rows):
    (x_ref,) = refs
    return x_ref[s, :, ks] if self.per_slot else x_ref[:, ks]


@dataclasses.dataclass(frozen=True)
class Normed:
  """rms_norm(x, g, eps) for a shared x [m, k]: the program multiplies x * g (rounded to x's dtype, where
  the reference rounds the normalized row) and scales its result by the row's r = rsqrt(mean(x^2) + eps)."""
  eps: float
  operands = 2

  def slab(self, refs, s, expert, ks, rows):
    x_ref, g_ref = refs
    xs = x_ref[:, ks]
    return (xs.astype(jnp.float32) * g_ref[ks].astype(jnp.float32)[None, :]).astype(xs.dtype)

  def finish(self, refs, acc):
    # The whole rows are loaded only now, after the weight loop, so their latency hides under the
    # weight's loads instead of delaying the first of them.
    x_ref = refs[0]
    x = whole_row.load(x_ref, 0, x_ref.shape[0])
    return acc * jax.lax.rsqrt(whole_row.mean_square(x, x_ref.shape[1]) + self.eps)


@dataclasses.dataclass(frozen=True)
class Hidden:
  """x[s] = act(g) * u, or act(u), rounded to dtype, where u = round(sum_p up[s, p] * up_scale[e_s]) and
  g likewise from the gate's parts: the hidden layer of a feed-forward whose first product (per slot,
  the same experts) left its split-K partials [slots, splits, parts_rows, k] unsummed."""
  activation: Callable
  dtype: jnp.dtype
  splits: int
  up_scaled: bool
  gated: bool
  gate_scaled: bool

  @property
  def operands(self):
    return 1 + self.up_scaled + (1 + self.gate_scaled) * self.gated

  def slab(self, refs, s, expert, ks, rows):
    refs = list(refs)

    def total(scaled):
      parts_ref = refs.pop(0)
      v = parts_ref[s, 0, :, ks]
      for p in range(1, self.splits):  # static: Triton blocks need no power-of-two count of parts
        v = v + parts_ref[s, p, :, ks]
      if scaled:
        v = v * refs.pop(0)[expert, ks].astype(jnp.float32)[None, :]
      return v.astype(self.dtype).astype(jnp.float32)

    u = total(self.up_scaled)
    h = self.activation(total(self.gate_scaled)) * u if self.gated else self.activation(u)
    h = h.astype(self.dtype)
    if h.shape[0] != rows:  # one row of parts into a dot's padded rows: rows past the first are zero
      first = jax.lax.broadcasted_iota(jnp.int32, (rows, h.shape[1]), 0) == 0
      h = jnp.where(first, jnp.broadcast_to(h, (rows, h.shape[1])), jnp.zeros((), h.dtype))
    return h


@dataclasses.dataclass(frozen=True)
class Activated:
  """An epilogue for a program that holds its columns' whole sum (one split): it writes the feed-forward's
  hidden layer h = act(round(acc * scale[e_s])) rounded to dtype, as Hidden and the two-call form round it,
  so the second product reads h in dtype and no kernel of its own computes it. Operands: the scale, if scaled."""
  activation: Callable
  dtype: jnp.dtype
  scaled: bool

  def finish(self, refs, expert, cols, acc):
    if self.scaled:
      acc = acc * refs[0][expert, cols].astype(jnp.float32)[None, :]
    return self.activation(acc.astype(self.dtype).astype(jnp.float32)).astype(self.dtype)


def _kernel(experts_ref, *refs, source, cfg: Config, steps: int, precision, epilogue: Activated | None = None):
  x_refs, w_ref, out_ref = refs[:source.operands], refs[source.operands], refs[-1]
  epilogue_refs = refs[source.operands + 1:-1]
  s, j, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  # A slot whose id is outside [0, E) holds no expert (the op's contract): it skips the loop, so it reads no
  # weight, and writes zeros. decode_moe pads its distinct experts with such slots, two in three
  # of them at batch 32, which would otherwise each stream an expert through the SMs again.
  e = experts_ref[s]
  present = (e >= 0) & (e < w_ref.shape[0])
  expert = jnp.clip(e, 0, w_ref.shape[0] - 1)
  cols = pl.ds(pl.multiple_of(j * cfg.block_n, cfg.block_n), cfg.block_n)
  rows = out_ref.shape[-2]
  km = k_major(w_ref.dtype)

  def step(i, acc):
    ks = pl.ds(pl.multiple_of((p * steps + i) * cfg.block_k, cfg.block_k), cfg.block_k)
    xs = source.slab(x_refs, s, expert, ks, rows)
    if cfg.use_dot:
      if km:  # [block_n, block_k]: contracted on its K axis
        return acc + jax.lax.dot_general(xs, w_ref[expert, cols, ks].astype(xs.dtype), (((1,), (1,)), ((), ())),
                                         precision=precision, preferred_element_type=jnp.float32)
      return acc + jax.lax.dot_general(xs, w_ref[expert, ks, cols].astype(xs.dtype), (((1,), (0,)), ((), ())),
                                       precision=precision, preferred_element_type=jnp.float32)
    # One row: a multiply-reduce in float32 (no tensor-core tile to fill; exact for int8 weights).
    x32 = xs.astype(jnp.float32)
    if km:  # [block_n, block_k] products accumulated as they are; summed over K once, after the loop
      return acc + x32 * weights_as(w_ref[expert, cols, ks], jnp.float32)
    return acc + jnp.sum(x32[:, :, None] * weights_as(w_ref[expert, ks, cols], jnp.float32)[None], axis=1)

  zeros = jnp.zeros((rows, cfg.block_n), jnp.float32)
  # k-major one row: the K axis is the one threads share, so a sum over it each step would reduce across
  # threads through shared memory every step (Triton 3.6's SASS: 86 shared stores against 7 for n-major).
  deferred = km and not cfg.use_dot

  def product(_):
    if deferred:
      acc = jnp.sum(jax.lax.fori_loop(0, steps, step, jnp.zeros((cfg.block_n, cfg.block_k), jnp.float32)),
                    axis=1)[None]
    else:
      acc = jax.lax.fori_loop(0, steps, step, zeros)
    acc = source.finish(x_refs, acc) if isinstance(source, Normed) else acc
    return acc if epilogue is None else epilogue.finish(epilogue_refs, expert, cols, acc)

  # A branch, not a trip count of zero: Pallas Triton lowers a loop with a traced bound to an scf.while
  # that Triton failed to compile (H100, jax 0.11.2).
  out_ref[...] = jax.lax.cond(present, product, lambda _: zeros.astype(out_ref.dtype), None)


@shared_lowering("source", "m", "dtype", "cfg", "epilogue")
def skinny_matmul_parts(
    x_operands: tuple,
    source,
    w: Num[Array, "experts k n"],
    experts: Int[Array, "slots"],
    m: int,
    dtype,
    cfg: Config,
    *,
    interpret: bool,
    epilogue: Activated | None = None,
    epilogue_operands: tuple = (),
) -> Float[Array, "slots splits rows n"]:
  """The split-K partials: y[s] = sum_p parts[s, p, :m] (rows past m are padding), float32, unscaled.
  With an epilogue (one split only) the one part is its result, in the epilogue's dtype.

  x_operands are what `source` reads: (x,) for Plain (x padded here), (x, g) for Normed, the parts and
  scales for Hidden. m is x's row count and dtype its dtype (Hidden's rounding)."""
  k, n = kn(w)
  if epilogue is not None and k != cfg.rows_per_program:
    raise ValueError(f"an epilogue needs one split: rows_per_program {cfg.rows_per_program} != k {k}.")
  slots = experts.shape[0]
  mp = padded_rows(m, cfg.use_dot)
  if not isinstance(source, Hidden) and mp != m:
    x = x_operands[0]
    x_operands = (jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, mp - m), (0, 0)]),) + tuple(x_operands[1:])
  splits = k // cfg.rows_per_program
  kernel = functools.partial(_kernel, source=source, cfg=cfg, steps=cfg.rows_per_program // cfg.block_k,
                             precision=dot_precision(dtype), epilogue=epilogue)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  return launch_dependents.pallas_call(
      kernel,
      grid=(slots, n // cfg.block_n, splits),
      in_specs=[pl.no_block_spec] * (2 + len(x_operands) + len(epilogue_operands)),
      out_specs=pl.BlockSpec((None, None, mp, cfg.block_n), lambda s, j, p: (s, p, 0, j)),
      out_shape=jax.ShapeDtypeStruct((slots, splits, mp, n), jnp.float32 if epilogue is None else epilogue.dtype),
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_skinny_matmul",
  )(experts.astype(jnp.int32), *x_operands, w, *epilogue_operands)
