"""decode_qkv_product at one row as ONE Pallas Triton kernel: the qkv product, RoPE and the cache slot.

At one row the split form runs the qkv product as skinny_matmul's split-K kernel and decode_qkv (triton.py)
then sums its parts, rotates q and k and writes the cache slot: two one-wave kernels, and at one row a
kernel's time is mostly its fixed cost (notes_decode.md). Here program (p, s), p = which x heads + h for
which in (q, k, v), owns COLUMNS columns of each half of head h's projection `which`, over the whole of K:

  y1 = xn W[:, c1],  y2 = xn W[:, c2]   (c1 = p dh + s COLUMNS + [0, COLUMNS), c2 = c1 + dh / 2; float32, rounded)
  q, k: (y1 cos - y2 sin, y2 cos + y1 sin) at position index - start;  v: (y1, y2)

so each program's values are complete: no program waits on another. xn is x, or rms_norm(x, g) folded as
skinny_matmul's Normed folds it (x * g rounded, the products scaled by rsqrt(mean(x^2) + eps)). q goes to
its own output, k and v into slot `index` of the caches, which are aliased to the outputs.
Reference: reference.decode_qkv_product_reference; off the GPU the kernel runs in Pallas' interpret mode.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, Num

from sparsejax.kernels.shared_lowering import shared_lowering

# Columns of each half a program owns: 8 bf16 columns are a 16-byte row segment, one vector load a row,
# and medium's 48 projection-heads of 64 make 192 programs of 32 KB (a wave and a half of the H100's SMs).
COLUMNS = 8
NUM_WARPS = 4


def fits(rows: int, d: int, dh: int) -> bool:
  """One row, d a power of two within a Triton block of x (at most 4,096), and halves of dh that COLUMNS
  divides."""
  return rows == 1 and 16 <= d <= 4096 and d & (d - 1) == 0 and dh % 2 == 0 and (dh // 2) % COLUMNS == 0


def _kernel(index_ref, start_ref, inv_ref, *refs, normed: bool, eps: float, heads: int, dh: int, dtype):
  x_ref, g_ref = (refs[0], refs[1]) if normed else (refs[0], None)
  w_ref, k_in, v_in, q_ref, k_ref, v_ref = refs[2 if normed else 1:]
  del k_in, v_in  # the same buffers as k_ref and v_ref
  p, s = pl.program_id(0), pl.program_id(1)
  half, d = dh // 2, x_ref.shape[-1]
  lo = pl.multiple_of(p * dh + s * COLUMNS, COLUMNS)
  # The weights first: they depend on nothing, so their loads are in flight while x arrives.
  w1 = w_ref[:, pl.ds(lo, COLUMNS)]
  w2 = w_ref[:, pl.ds(lo + half, COLUMNS)]
  f32 = lambda v: v.astype(jnp.float32)
  rnd = lambda v: v.astype(dtype).astype(jnp.float32)
  x = x_ref[0, :]
  if normed:
    xs = f32((f32(x) * f32(g_ref[:])).astype(x.dtype))
    r = jax.lax.rsqrt(jnp.sum(f32(x) * f32(x)) / d + eps)
  else:
    xs, r = f32(x), None

  def product(w):
    v = jnp.sum(xs[:, None] * f32(w.astype(x.dtype)), axis=0)  # weights enter as x's dtype, as skinny's do
    return rnd(v * r if r is not None else v)

  y1, y2 = product(w1), product(w2)
  which, h = p // heads, p % heads
  index = index_ref[0]
  # The write clamps into the cache as kv_cache.write does (decode_qkv's kernel says why); RoPE keeps the
  # unclamped position, as the reference does.
  slot = jnp.clip(index, 0, k_ref.shape[1] - 1)
  angle = (index - start_ref[0]).astype(jnp.float32) * inv_ref[pl.ds(pl.multiple_of(s * COLUMNS, COLUMNS), COLUMNS)]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  first, second = pl.ds(pl.multiple_of(s * COLUMNS, COLUMNS), COLUMNS), pl.ds(pl.multiple_of(half + s * COLUMNS, COLUMNS), COLUMNS)

  def store(ref, idx, a, b):
    ref[idx + (first,)] = a.astype(dtype).astype(ref.dtype)
    ref[idx + (second,)] = b.astype(dtype).astype(ref.dtype)

  @pl.when(which == 0)
  def _():
    store(q_ref, (0, h), y1 * cos - y2 * sin, y2 * cos + y1 * sin)

  @pl.when(which == 1)
  def _():
    store(k_ref, (0, slot, h), y1 * cos - y2 * sin, y2 * cos + y1 * sin)

  @pl.when(which == 2)
  def _():
    store(v_ref, (0, slot, h), y1, y2)


@shared_lowering("eps", "dtype")
def decode_qkv_product(
    x_operands: tuple,
    w: Num[Array, "d three_h_dh"],
    k_cache: Float[Array, "1 s h dh"],
    v_cache: Float[Array, "1 s h dh"],
    index: Int[Array, ""],
    start: Int[Array, "1"],
    inv_freq: Float[Array, "half"],
    eps: float | None,
    dtype,
    *,
    interpret: bool,
) -> tuple[Float[Array, "1 h dh"], Float[Array, "1 s h dh"], Float[Array, "1 s h dh"]]:
  """(q, k_cache, v_cache) of reference.decode_qkv_product_reference; the caches are updated in place.
  x_operands: (x [1, d],) or, with the norm folded (eps not None), (x, g [d])."""
  _, _, heads, dh = k_cache.shape
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
  normed = eps is not None
  kernel = functools.partial(_kernel, normed=normed, eps=float(eps or 0.0), heads=heads, dh=dh,
                             dtype=jnp.dtype(dtype))
  n_in = 3 + len(x_operands) + 3
  return pl.pallas_call(
      kernel,
      grid=(3 * heads, dh // 2 // COLUMNS),
      in_specs=[pl.no_block_spec] * n_in,
      out_specs=[pl.no_block_spec] * 3,
      out_shape=[jax.ShapeDtypeStruct((1, heads, dh), dtype), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
      input_output_aliases={n_in - 2: 1, n_in - 1: 2},
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_decode_qkv_product",
  )(jnp.reshape(index, (1,)).astype(jnp.int32), start.astype(jnp.int32), inv_freq, *x_operands, w, k_cache, v_cache)
