"""residual_norm as a Pallas Triton kernel: one program per row does what XLA runs as ~3-7 kernels.

In a decode step each of those kernels moves a few kilobytes and costs its launch (~1.3 us on an
H100): the layer output's sum and residual add, RMSNorm's reduce and its scale, and before an MoE
layer the router's logits, softmax, top-k and weights (experiments/notes_decode.md). Program r
reads row r's residual x and the layer's split-K partials (the products' unsummed output, so no
kernel sums them first), and in two passes over d in `block`-wide pieces accumulates sum(h^2), then
writes h and n and accumulates n W_r. The router's softmax and k argmax passes run on the [E]
logits in registers. Every load is in bounds and unmasked: d a multiple of the block, E and the
block powers of two (op.py sends other shapes to XLA). Reference: reference.py. Off the GPU the
kernel runs in Pallas' interpret mode (tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

BLOCK = 256
NUM_WARPS, NUM_STAGES = 4, 1


def block_size(d: int) -> int | None:
  """The widest power of two <= BLOCK dividing d (at least 16), else None (XLA then)."""
  return next((b for b in (256, 128, 64, 32, 16) if b <= BLOCK and d % b == 0), None)


def _kernel(*refs, d, block, slots, splits, eps, dtype, k, renormalize, has_parts, has_combine, has_router):
  it = iter(refs)
  x_ref = next(it)
  parts_ref = next(it) if has_parts else None
  combine_ref = next(it) if has_combine else None
  scale_ref = next(it)
  w_ref = next(it) if has_router else None
  h_ref, n_ref = next(it), next(it)
  if has_router:
    logits_ref, ids_ref, weights_ref = next(it), next(it), next(it)
  r = pl.program_id(0)
  f32 = jnp.float32
  rnd = lambda v: v.astype(dtype).astype(f32)  # where the unfused layer stores in dtype

  def h_piece(b):
    cols = pl.ds(pl.multiple_of(b * block, block), block)
    h = x_ref[r, cols].astype(f32)
    if not has_parts:
      return cols, h
    delta = jnp.zeros((block,), f32)
    for s in range(slots):
      y = parts_ref[s, 0, r, cols]
      for p in range(1, splits):
        y = y + parts_ref[s, p, r, cols]
      delta = delta + (combine_ref[r, s] * rnd(y) if has_combine else rnd(y))
    return cols, rnd(h + rnd(delta))

  def sum_sq(b, acc):
    h = h_piece(b)[1]
    return acc + jnp.sum(h * h)

  pieces = d // block
  rs = jax.lax.rsqrt(jax.lax.fori_loop(0, pieces, sum_sq, jnp.zeros((), f32)) / d + eps)

  def write(b, logits):
    cols, h = h_piece(b)
    h_ref[r, cols] = h.astype(dtype)
    n = (h * rs * scale_ref[cols].astype(f32)).astype(dtype)
    n_ref[r, cols] = n
    if not has_router:
      return logits
    w = w_ref[cols, :].astype(f32)  # [block, E]
    return logits + jnp.sum(n.astype(f32)[:, None] * w, axis=0)

  num_experts = w_ref.shape[1] if has_router else 1
  logits = jax.lax.fori_loop(0, pieces, write, jnp.zeros((num_experts,), f32))
  if not has_router:
    return
  logits_ref[r, :] = logits
  e = jax.lax.broadcasted_iota(jnp.int32, (num_experts,), 0)
  p = jnp.exp(logits - jnp.max(logits))
  p = p / jnp.sum(p)
  left, total = p, jnp.zeros((), f32)
  picked = []
  for j in range(k):  # argmax passes: the largest left, the lowest index among ties
    top = jnp.max(left)
    idx = jnp.min(jnp.where(left == top, e, num_experts))
    picked.append((idx, top))
    total = total + top
    left = jnp.where(e == idx, -1.0, left)
  for j, (idx, top) in enumerate(picked):
    ids_ref[r, j] = idx
    weights_ref[r, j] = top / total if renormalize else top


def residual_norm(
    x: Float[Array, "m d"],
    parts: Float[Array, "slots splits rows d"] | None,
    combine: Float[Array, "m slots"] | None,
    scale: Float[Array, "d"],
    w_router: Float[Array, "d experts"] | None,
    *,
    eps: float,
    k: int,
    renormalize: bool,
    interpret: bool,
) -> tuple:
  """(h, n) or (h, n, logits, ids, weights) as reference.residual_norm_reference (op.py checks shapes)."""
  m, d = x.shape
  block = block_size(d)
  slots, splits = (parts.shape[0], parts.shape[1]) if parts is not None else (1, 1)
  args = [x] + ([parts] if parts is not None else []) + ([combine] if combine is not None else [])
  args += [scale] + ([w_router] if w_router is not None else [])
  out_shape = [jax.ShapeDtypeStruct((m, d), x.dtype)] * 2
  if w_router is not None:
    num_experts = w_router.shape[1]
    out_shape += [jax.ShapeDtypeStruct((m, num_experts), jnp.float32), jax.ShapeDtypeStruct((m, k), jnp.int32),
                  jax.ShapeDtypeStruct((m, k), jnp.float32)]
  kernel = functools.partial(
      _kernel, d=d, block=block, slots=slots, splits=splits, eps=eps, dtype=x.dtype, k=k,
      renormalize=renormalize, has_parts=parts is not None, has_combine=combine is not None,
      has_router=w_router is not None)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
  return tuple(pl.pallas_call(
      kernel,
      grid=(m,),
      in_specs=[pl.no_block_spec] * len(args),
      out_specs=[pl.no_block_spec] * len(out_shape),
      out_shape=out_shape,
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_residual_norm",
  )(*args))
