"""decode_router as Pallas Triton kernels: a decode step's router in two kernels instead of XLA's six.

At decode time a token's routing is a [1, d] x [d, E] product and three reductions over E numbers.
XLA ran it as six kernels a layer (the float32 product as a bf16 split and a multiply-reduce, the
softmax, the argmax, its index, the weight), and its one-row product came out at bf16 accuracy
(routing._matmul). Here programs (t, s) each read d / splits rows of W_r as [block_k, E] tiles into
float32 partial logits (an elementwise multiply and a sum: exact products of bf16 operands, no TF32
anywhere), and a second kernel, one program per token, sums them, takes the softmax and the k
largest probabilities (the lower index first among equal ones, as top_k_small) in registers.
With splits = 1 (an odd number of tiles) one kernel does both: one SM then pulls all of W_r, one
tile's latency after another, which op.py's "auto" leaves to XLA unless W_r is a single tile. Measured on an H100 (medium MoE, batch 1): the
decode step 1.03 -> 0.92 ms (experiments/notes_decode.md). Reference: reference.py. Off the GPU the
kernels run in Pallas' interpret mode (tests).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from sparsejax.kernels import launch_dependents, whole_row
from sparsejax.kernels.shared_lowering import shared_lowering


@dataclasses.dataclass(frozen=True)
class Config:
  """W_r is read in [block_k, E] tiles. splits = 1: program t reads all of W_r and selects. splits > 1
  (a power of two): programs (t, s) each read d / splits rows of W_r into partial logits, and a second
  kernel, one program per token, sums the splits and selects: one SM pulling all of W_r waits on
  one tile's latency after another, many SMs each pulling one tile do not."""
  block_k: int
  splits: int = 1
  num_warps: int = 4
  num_stages: int = 3


# Numbers of W_r a program's [block_k, E] float32 tile may hold: 8,192 is 64 a thread at 4 warps. At medium's
# d 1,024 and E 64, 4,096 and 2,048 (16 and 32 programs) ran the step 0.997x and 0.995x, a tie
# (experiments/results/decode_router_splits_ab_H100.log).
TILE_NUMBERS = 8192


# Programs the split form asks for where each would read several tiles (d_model / block_k not a power of two:
# small's 768 is six [128, 64] tiles, three a program over two programs, each loading the row for the norm
# first): block_k shrinks until this many. At small-moe's batch 1 on an H200, eight programs of three [32, 64]
# tiles ran the step 0.964x the time of two (every round below 1), sixteen of [16, 64] 0.974x
# (experiments/results/decode_router_tiles{2048,1024}_small_ab_H200.log). Where one tile a program makes fewer,
# it stays: xs's four programs against eight of [64, 64] tiles ran 0.991x, a tie
# (decode_router_tiles4096_xs_ab_H200.log).
MIN_SPLITS = 8


def default_config(d_model: int, num_experts: int) -> Config | None:
  """The largest block_k of (128, 64, 32, 16) dividing d_model whose [block_k, E] float32 tile stays
  within TILE_NUMBERS; splits = the largest power of two up to 64 dividing the d_model / block_k tiles. Where
  that leaves a program several tiles and fewer than MIN_SPLITS programs, the largest smaller block_k that makes
  MIN_SPLITS, if one does. None when no block_k divides d_model."""
  def config(bk):
    tiles = d_model // bk
    return Config(block_k=bk, splits=min(tiles & -tiles, 64))

  fitting = [bk for bk in (128, 64, 32, 16) if d_model % bk == 0 and bk * num_experts <= TILE_NUMBERS]
  if not fitting:
    return None
  first = config(fitting[0])
  if first.splits * first.block_k < d_model and first.splits < MIN_SPLITS:
    return next((c for c in map(config, fitting[1:]) if c.splits >= MIN_SPLITS), first)
  return first


def norm_fits(d_model: int) -> bool:
  """Whether a program can fold the RMSNorm of x's row in: it loads the whole row (whole_row: d_model padded
  to a power of two, at most 16,384 numbers) to take its root mean square."""
  return whole_row.width(d_model) <= 16384


def _row(x_ref, pend_ref, t, cols=None):
  """x[t, cols] as [1, n], or with cols None the whole row as whole_row's block; with pend_ref (float32
  [P, rows, d]: a product's split-K parts, not yet summed) the block's residual add as XLA rounds it,
  round(x + round(sum_p pend[p, t, cols])), the parts summed in order."""
  def part(ref, *lead):
    return whole_row.load(ref, t, 1, lead) if cols is None else ref[(*lead, pl.ds(t, 1), cols)]

  xs = part(x_ref)
  if pend_ref is None:
    return xs
  y = part(pend_ref, 0)
  for p in range(1, pend_ref.shape[0]):
    y = y + part(pend_ref, p)
  return (xs.astype(jnp.float32) + y.astype(x_ref.dtype).astype(jnp.float32)).astype(x_ref.dtype)


def _partial_logits(x_ref, w_ref, t, first, steps: int, block_k: int, g_ref=None, eps=None, pend_ref=None):
  """([1, E] float32, the row): the sum over rows first .. first + steps * block_k of xn[t, r] W_r[r, :], with
  xn = x, or with g_ref rms_norm(x, g, eps) rounded to x's dtype as the norm's module rounds it; x is _row's (the
  residual add of pend_ref's parts where given). The row is x[t] whole (whole_row's [1, width(d)] block) where
  the norm loads it, else None."""
  e, d = w_ref.shape[1], x_ref.shape[1]
  x_row = _row(x_ref, pend_ref, t) if g_ref is not None else None  # the norm's whole row

  def tile(i):
    start = first + i * block_k
    # A hint for a traced offset; the one-program form's single tile starts at the constant 0.
    ks = pl.ds(start if isinstance(start, int) else pl.multiple_of(start, block_k), block_k)
    return ks, w_ref[ks, :].astype(jnp.float32)  # [block_k, E]

  def xs_of(ks, r):
    xs = _row(x_ref, pend_ref, t, ks)  # [1, block_k]
    if g_ref is not None:
      xs = (xs.astype(jnp.float32) * r * g_ref[ks].astype(jnp.float32)[None, :]).astype(x_ref.dtype)
    return xs.astype(jnp.float32)

  def rms_scale():
    if g_ref is None:
      return None
    return jax.lax.rsqrt(whole_row.mean_square(x_row, d) + eps)

  if steps == 1:  # the split form's one tile: its load is issued before the norm waits on the row
    ks, ws = tile(0)
    return jnp.sum(xs_of(ks, rms_scale())[:, :, None] * ws[None], axis=1), x_row
  r = rms_scale()

  def step(i, acc):
    ks, ws = tile(i)
    return acc + jnp.sum(xs_of(ks, r)[:, :, None] * ws[None], axis=1)

  return jax.lax.fori_loop(0, steps, step, jnp.zeros((1, e), jnp.float32)), x_row


def summed_logits(part_ref, t, splits: int):
  """[E] float32: token t's partial logits part_ref[t, s, :] summed in split order. A fixed order of elementwise
  adds, so every kernel that sums them (the select kernel, and the row FFN and its epilogue where they route
  themselves) gets the same numbers whatever its layout, and so the same ids."""
  logits = part_ref[t, 0, :]
  for s in range(1, splits):
    logits = logits + part_ref[t, s, :]
  return logits


def top_ids(logits, k: int) -> list:
  """The k largest of [E] logits as int32 scalars, largest first, the lower index first among equal ones.
  Exact (maxima and comparisons only), so every kernel that takes them from the same logits agrees."""
  e = logits.shape[0]
  col = jax.lax.broadcasted_iota(jnp.int32, (e,), 0)
  free = jnp.ones((e,), jnp.int32)  # 0 once taken: a mask, not -inf, so a logit of -inf is still taken in turn
  ids = []
  for _ in range(k):
    best = jnp.max(jnp.where(free > 0, logits, -jnp.inf))
    idx = jnp.min(jnp.where((free > 0) & (logits == best), col, e))
    ids.append(idx)
    free = jnp.where(col == idx, 0, free)
  return ids


def weights_of(logits, ids: list, renormalize: bool) -> list:
  """p[ids] as float32 scalars, p = softmax(logits) (jax.nn.softmax's formula); divided by their sum when
  renormalize."""
  e = logits.shape[0]
  col = jax.lax.broadcasted_iota(jnp.int32, (e,), 0)
  z = jnp.exp(logits - jnp.max(logits))
  p = z / jnp.sum(z)
  wts = [jnp.sum(jnp.where(col == i, p, 0.0)) for i in ids]
  if renormalize:
    total = wts[0]
    for w in wts[1:]:
      total = total + w
    wts = [w / total for w in wts]
  return wts


def _select(logits, ids_ref, wts_ref, *, k: int, renormalize: bool):
  """[E] logits: the k largest (top_ids), and their softmax probabilities (weights_of)."""
  kp = ids_ref.shape[-1]
  slot = jax.lax.broadcasted_iota(jnp.int32, (1, kp), 1)
  ids = top_ids(logits, k)
  wts = weights_of(logits, ids, renormalize)
  id_row, wt_row = jnp.zeros((1, kp), jnp.int32), jnp.zeros((1, kp), jnp.float32)  # slots past k hold 0
  for j in range(k):
    id_row = jnp.where(slot == j, ids[j], id_row)
    wt_row = jnp.where(slot == j, wts[j], wt_row)
  ids_ref[...] = id_row
  wts_ref[...] = wt_row


def _route_kernel(x_ref, w_ref, *refs, cfg: Config, k: int, renormalize: bool, eps):
  g_ref, (ids_ref, wts_ref) = (refs[0], refs[1:]) if eps is not None else (None, refs)
  steps = w_ref.shape[0] // cfg.block_k
  logits, _ = _partial_logits(x_ref, w_ref, pl.program_id(0), 0, steps, cfg.block_k, g_ref, eps)
  _select(jnp.sum(logits, axis=0), ids_ref, wts_ref, k=k, renormalize=renormalize)


def _split_kernel(x_ref, w_ref, *refs, cfg: Config, eps, pending: bool):
  refs = list(refs)
  g_ref = refs.pop(0) if eps is not None else None
  pend_ref = refs.pop(0) if pending else None
  part_ref, *h_ref = refs
  t, s = pl.program_id(0), pl.program_id(1)
  steps = w_ref.shape[0] // (cfg.splits * cfg.block_k)
  logits, x_row = _partial_logits(x_ref, w_ref, t, s * steps * cfg.block_k, steps, cfg.block_k, g_ref, eps, pend_ref)
  part_ref[...] = logits[None]
  if pending:  # the residual stream after the add, for the kernels after the router

    @pl.when(s == 0)
    def _():
      whole_row.store(h_ref[0], t, x_row)


def _select_kernel(part_ref, ids_ref, wts_ref, *, k: int, renormalize: bool):
  _select(summed_logits(part_ref, 0, part_ref.shape[1]), ids_ref, wts_ref, k=k, renormalize=renormalize)


def decode_router(
    x: Float[Array, "tokens d_model"],
    w_router: Float[Array, "d_model experts"],
    k: int,
    renormalize: bool,
    cfg: Config,
    *,
    interpret: bool,
    norm: tuple[Float[Array, "d_model"], float] | None = None,
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
  """(ids, weights) of the k largest softmax(x W_r) per token; E a power of two (Triton's blocks).
  norm = (g, eps): of softmax(rms_norm(x, g, eps) W_r), the norm taken in every program (norm_fits)."""
  if norm is None:
    return _decode_router(x, w_router, None, k, renormalize, cfg, None, interpret=interpret)
  return _decode_router(x, w_router, norm[0], k, renormalize, cfg, float(norm[1]), interpret=interpret)


def _compiler_params(cfg: Config, interpret: bool):
  if interpret:
    return None
  from jax.experimental.pallas import triton as plt
  return plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _id_outputs(t: int, k: int) -> dict:
  """The ids' and weights' outputs, [t, k padded to a power of two] (Triton's blocks), a token's row a program."""
  kp = pl.next_power_of_2(k)
  return dict(out_specs=[pl.BlockSpec((1, kp), lambda i: (i, 0))] * 2,
              out_shape=[jax.ShapeDtypeStruct((t, kp), jnp.int32), jax.ShapeDtypeStruct((t, kp), jnp.float32)])


@shared_lowering("k", "renormalize", "cfg", "eps")
def _decode_router(x, w_router, g, k, renormalize, cfg, eps, *, interpret):
  """decode_router with the norm's scale g (or None) and eps (static) apart."""
  params = _compiler_params(cfg, interpret)
  if cfg.splits > 1:
    return _select_call(_split_logits(x, w_router, g, cfg, eps, params, interpret), k, renormalize, params, interpret)
  extra = () if g is None else (g,)
  ids, wts = launch_dependents.pallas_call(
      functools.partial(_route_kernel, cfg=cfg, k=k, renormalize=renormalize, eps=eps),
      grid=(x.shape[0],), in_specs=[pl.no_block_spec] * (2 + len(extra)), interpret=interpret,
      compiler_params=params, name="sparsejax_decode_router", **_id_outputs(x.shape[0], k))(x, w_router, *extra)
  return ids[:, :k], wts[:, :k]


def _select_call(part, k: int, renormalize: bool, params, interpret: bool):
  t, splits, e = part.shape
  ids, wts = launch_dependents.pallas_call(
      functools.partial(_select_kernel, k=k, renormalize=renormalize),
      grid=(t,), in_specs=[pl.BlockSpec((1, splits, e), lambda i: (i, 0, 0))],
      interpret=interpret, compiler_params=params, name="sparsejax_decode_router_select",
      **_id_outputs(t, k))(part)
  return ids[:, :k], wts[:, :k]


@shared_lowering("k", "renormalize")
def select(
    parts: Float[Array, "tokens splits experts"],
    k: int,
    renormalize: bool,
    *,
    interpret: bool,
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
  """The second kernel alone: (ids, weights) from logit_parts' partial logits, one program per token, with the
  two-kernel form's warps and stages (Config's)."""
  return _select_call(parts, k, renormalize, _compiler_params(Config(block_k=16), interpret), interpret)


def _split_logits(x, w_router, g, cfg: Config, eps, params, interpret: bool, pending=None):
  t, e = x.shape[0], w_router.shape[1]
  extra = (() if g is None else (g,)) + (() if pending is None else (pending,))
  out_specs = pl.BlockSpec((1, 1, e), lambda i, s: (i, s, 0))
  out_shape = jax.ShapeDtypeStruct((t, cfg.splits, e), jnp.float32)
  if pending is not None:
    out_specs, out_shape = (out_specs, pl.no_block_spec), (out_shape, jax.ShapeDtypeStruct(x.shape, x.dtype))
  return launch_dependents.pallas_call(
      functools.partial(_split_kernel, cfg=cfg, eps=eps, pending=pending is not None),
      grid=(t, cfg.splits), in_specs=[pl.no_block_spec] * (2 + len(extra)),
      out_specs=out_specs, out_shape=out_shape,
      interpret=interpret, compiler_params=params,
      name="sparsejax_decode_router_logits")(x, w_router, *extra)


def logit_parts(
    x: Float[Array, "tokens d_model"],
    w_router: Float[Array, "d_model experts"],
    cfg: Config,
    *,
    interpret: bool,
    norm: tuple[Float[Array, "d_model"], float] | None = None,
    pending: Float[Array, "p rows d_model"] | None = None,
) -> Float[Array, "tokens splits experts"] | tuple:
  """The first kernel alone (cfg.splits > 1): parts[t, s] = xn[t, R_s] W_r[R_s, :] in float32 over split s's rows
  R_s, xn = x or rms_norm(x, g, eps); for kernels that select themselves (summed_logits, top_ids, weights_of).
  pending (with norm): a product's split-K parts that the block adds to x first (_row's rounding), and the result
  is (parts, h) with h = that sum [tokens, d_model] in x's dtype, which programs (t, 0) store."""
  if cfg.splits < 2:
    raise ValueError(f"logit_parts runs the split form; cfg has splits={cfg.splits}.")
  if pending is not None and norm is None:
    raise ValueError("logit_parts takes pending parts with a norm (its programs then load the whole row).")
  g, eps = (None, None) if norm is None else (norm[0], float(norm[1]))
  return _logit_parts(x, w_router, g, pending, cfg, eps, interpret=interpret)


@shared_lowering("cfg", "eps")
def _logit_parts(x, w_router, g, pending, cfg, eps, *, interpret):
  return _split_logits(x, w_router, g, cfg, eps, _compiler_params(cfg, interpret), interpret, pending)
