"""skinny_matmul as a Pallas Triton kernel: split-K partial products that read each weight byte once.

At decode time a product has m <= 64 rows against a weight of megabytes: it is bound by the bytes of
the weight, and XLA's own lowering of an m = 1 dot (a broadcast multiply then a reduce, the product
written out in between) moves them at a third of the card's bandwidth. Here program (s, j, p) reads
the [rows, block_n] slab p of column block j of the slot's expert w[experts[s]] once and writes the
float32 partial x[s][:, slab] @ slab; the caller sums the partials (XLA fuses that sum into whatever
consumes it). Many small programs (the K dimension split into slabs) keep every SM loading.
Reference: reference.py. Off the GPU the kernel runs in Pallas' interpret mode (tests).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, Num

from sparsejax._precision import dot_precision

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


def _largest_dividing(n: int, candidates) -> int | None:
  return next((c for c in candidates if n % c == 0), None)


def default_config(m: int, k: int, n: int) -> Config | None:
  """Tiles picked from an H100 sweep (experiments/results/skinny_matmul_sweep_H100.json): 64 columns,
  128 K rows a program for one row and K <= 2048, else a dot over 256 (512 for K >= 2048) rows.
  None when k or n is not a multiple of 16 (the caller then uses the reference)."""
  block_n = _largest_dividing(n, (64, 32, 16))
  block_k = _largest_dividing(k, (128, 64, 32, 16))
  if block_n is None or block_k is None:
    return None
  use_dot = not (m == 1 and k <= 2048)
  target = 128 if not use_dot else (512 if k >= 2048 else 256)
  rows = max(r for r in range(block_k, max(target, block_k) + 1, block_k) if k % r == 0)
  return Config(block_n=block_n, block_k=block_k, rows_per_program=rows, use_dot=use_dot)


def padded_rows(m: int, use_dot: bool) -> int:
  """Rows the kernel computes: Triton's dot wants >= 16 and every block a power of two."""
  return max(16, pl.next_power_of_2(m)) if use_dot else 1


def norm_fits(m: int, k: int) -> bool:
  """Whether the kernel folds an RMSNorm of x's rows into the product: every program loads the whole
  (padded) rows, a power-of-two k, so only where they are at most 4,096 numbers. At 32 rows of 512
  (xs-moe at batch 32) the programs' copies of x made the step 18% slower on an H100
  (experiments/notes_decode.md); at one row of 1,024 folding took 9% off medium-moe's step."""
  return k & (k - 1) == 0 and padded_rows(m, m > 1 or k > 2048) * k <= 4096


def _kernel(experts_ref, x_ref, w_ref, *refs, cfg: Config, steps: int, x_per_slot: bool, precision,
            norm_eps: float | None):
  g_ref, out_ref = refs if norm_eps is not None else (None, refs[0])
  s, j, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  expert = experts_ref[s]
  cols = pl.ds(pl.multiple_of(j * cfg.block_n, cfg.block_n), cfg.block_n)
  rows = out_ref.shape[-2]
  # A folded RMSNorm: rms_norm(x) @ W = r * ((x * g) @ W), r = rsqrt(mean(x^2) + eps) per row. The
  # whole rows are loaded before the loop but reduced after it, so their latency hides under the
  # weight's loads instead of delaying the first of them.
  x_rows = x_ref[...] if g_ref is not None else None

  def step(i, acc):
    ks = pl.ds(pl.multiple_of((p * steps + i) * cfg.block_k, cfg.block_k), cfg.block_k)
    xs = x_ref[s, :, ks] if x_per_slot else x_ref[:, ks]
    if g_ref is not None:
      xs = (xs.astype(jnp.float32) * g_ref[ks].astype(jnp.float32)[None, :]).astype(xs.dtype)
    ws = w_ref[expert, ks, cols]
    if cfg.use_dot:
      return acc + jax.lax.dot_general(xs, ws.astype(xs.dtype), (((1,), (0,)), ((), ())),
                                       precision=precision, preferred_element_type=jnp.float32)
    # One row: a multiply-reduce in float32 (no tensor-core tile to fill; exact for int8 weights).
    return acc + jnp.sum(xs.astype(jnp.float32)[:, :, None] * ws.astype(jnp.float32)[None], axis=1)

  acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((rows, cfg.block_n), jnp.float32))
  if g_ref is not None:
    x32 = x_rows.astype(jnp.float32)
    acc = acc * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=1, keepdims=True) + norm_eps)
  out_ref[...] = acc


def skinny_matmul(
    x: Float[Array, "slots m k"] | Float[Array, "m k"],
    w: Num[Array, "experts k n"],
    experts: Int[Array, "slots"],
    cfg: Config,
    *,
    interpret: bool,
    norm: tuple[Float[Array, "k"], float] | None = None,
) -> Float[Array, "slots m n"]:
  """y[s] = x[s] @ w[experts[s]] (x [m, k] is shared by every slot), float32; no scale applied here.
  norm = (g, eps): y[s] = rms_norm(x, g, eps) @ w[experts[s]] for a shared x (norm_fits), as
  r * ((x * g) @ w): x * g rounded to x's dtype where the reference rounds rms_norm(x)."""
  x_per_slot = x.ndim == 3
  m, k = x.shape[-2:]
  n = w.shape[-1]
  slots = experts.shape[0]
  mp = padded_rows(m, cfg.use_dot)
  if mp != m:
    pad = [(0, 0)] * (x.ndim - 2) + [(0, mp - m), (0, 0)]
    x = jnp.pad(x, pad)
  splits = k // cfg.rows_per_program
  kernel = functools.partial(_kernel, cfg=cfg, steps=cfg.rows_per_program // cfg.block_k,
                             x_per_slot=x_per_slot, precision=dot_precision(x.dtype),
                             norm_eps=None if norm is None else float(norm[1]))
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  partial = pl.pallas_call(
      kernel,
      grid=(slots, n // cfg.block_n, splits),
      in_specs=[pl.no_block_spec] * (3 if norm is None else 4),
      out_specs=pl.BlockSpec((None, None, mp, cfg.block_n), lambda s, j, p: (s, p, 0, j)),
      out_shape=jax.ShapeDtypeStruct((slots, splits, mp, n), jnp.float32),
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_skinny_matmul",
  )(experts.astype(jnp.int32), x, w, *(() if norm is None else (norm[0],)))
  return partial.sum(axis=1)[:, :m]
