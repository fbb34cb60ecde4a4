"""skinny_ffn at one row as ONE Pallas Triton kernel: each program owns a slab of the hidden layer.

The split form (triton.py) runs a one-row feed-forward as two one-wave kernels, and at one row a kernel's
time is mostly a fixed cost (its ramp, the latency of its first loads, its tail), not its bytes: on an
H100 a one-wave Triton read of 8 MB takes ~5 us and of 16 MB ~8 us (experiments/probe_slab_ffn.py). Here
program (s, j) owns hidden columns F_j of slot s's expert and takes them through both products, so no
program waits on another and the whole expert's weights stream through one kernel:

  u_j = x W_in[e][:, F_j] (* s_in)     h_j = round(act(round(u_j)))  (GLU: round(act(round(g_j)) round(u_j)))
  parts[s, j] = h_j W_out[e][F_j, :]                        (float32 [d]; the caller sums over j)

A program issues its W_out slab's loads first (they depend on nothing it computes), then W_in's (and
W_gate's), and holds them in registers: F_j is slab_columns wide (64 bytes of every W_in row in bf16, 32
in int8: 32 columns either way, halved to 16 where twice the programs still fit a wave), so a program
reads d x that of each weight (int8 weights are k-major, reference.k_major: its W_in slab is then c whole
rows of W_in^T, and its W_out slab d rows of c bytes). Where d is not a power of two (small's 768), slabs, x
and the parts' row are taken in power-of-two pieces of d (whole_row.pieces: 512 + 256). x comes as Plain (one
row, or one per slot) or Normed (the row's RMSNorm folded as triton.Normed folds it: x * g rounded, the product
scaled by rsqrt(mean(x^2) + eps)); the rounding of u, g and h is the split form's (op._hidden). At a decode
step's one token the kernel can route itself (Routed): each program takes its slot's expert from the router's partial
logits, so the router's select kernel never runs (op.routed_ffn_residual). Reference: op.skinny_ffn's
reference (the two-call form); off the GPU the kernel runs in Pallas' interpret mode
(tests/test_skinny_matmul.py).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, Num

from sparsejax.kernels import launch_dependents, whole_row
from sparsejax.kernels.decode_router.triton import summed_logits, top_ids, weights_of
from sparsejax.kernels.shared_lowering import shared_lowering
from sparsejax.kernels.skinny_matmul.reference import k_major, kn
from sparsejax.kernels.skinny_matmul.triton import Normed, weights_as

# Bytes of a W_in row a program reads where the feed-forward makes a wave of programs at this width. bf16: 64 (two
# 32-byte sectors, 32 columns) measured best; 32-byte rows (16 columns) ran medium's step 13% slower on an H100.
SLAB_ROW_BYTES = 64
# int8: 32 bytes (32 columns, as bf16's), so medium's f 4,096 makes 128 programs at one slot. In one-process A-Bs
# of the medium-moe step against int8's split form it ran 0.986-0.991x its time in four runs (16 rounds each;
# experiments/results/decode_row_ffn_int8_epilogue_ab{,2}_H100.log); 64-byte int8 rows (64 programs) ran 1.076x
# (decode_row_ffn_int8_ab_H100.log), and 16-byte rows (256 programs) 1.066x on an H200
# (decode_int8_slab16_medium_ab_H200.log).
SLAB_ROW_BYTES_INT8 = 32
# Weight bytes a program holds in registers: 128 KB over 8 warps is 128 registers a thread (medium's
# d 1,024 in bf16, non-gated); more spills.
MAX_PROGRAM_BYTES = 128 * 1024
# Power-of-two pieces a row of d (or the epilogue's P parts) may take (whole_row.pieces): 768 = 512 + 256 and
# every d a multiple of 256 up to 2,048 take at most three.
MAX_PIECES = 3
NUM_WARPS = 8
# Programs (slots x f / c) a wave holds: the H100's and the H200's 132 SMs. The slab narrows only while the
# programs it then makes still fit one wave: 16 columns at small's f 3,072 (192 programs, a wave and a half) ran
# its step 1.07x the time of 32 columns (96 programs) on an H200 (decode_row_ffn_pieces_small_c32_ab_H200.log).
WAVE_PROGRAMS = 132
# The fewest programs the form takes (else the split form's two kernels run): 64 (xs's f 2,048 at 32 columns)
# ran 6-10% slower than the split form in bench_decode's steps on an H100; 96 (small's f 3,072 at 32 columns)
# ran the step 0.96x (bf16) and 0.95x (int8) the split form's time on an H200
# (decode_row_ffn_pieces_landed_small{,_int8}_ab_H200.log).
MIN_PROGRAMS = 96
# The narrowest slab. At xs's f 2,048 (16 columns, 128 programs, where 32 made 64) the row form ran the step
# 0.915x the split form's time in bf16, 0.925x in int8 (twice) and 0.943x in xs-dense, every round below 1
# (one-process A-Bs on an H200, experiments/results/decode_{bf16_slab32,int8_slab16}_xs*_ab*_H200.log); at medium's
# f 4,096 16 columns (256 programs against 128) ran 1.066x (decode_int8_slab16_medium_ab_H200.log).
MIN_SLAB_COLUMNS = 16


def slab_columns(w_dtype, f: int, slots: int = 1) -> int:
  """c: the hidden columns a program owns. The configured width (SLAB_ROW_BYTES_INT8 of a W_in row for int8
  weights, else SLAB_ROW_BYTES), halved while twice the programs (slots x f / c) still fit WAVE_PROGRAMS and
  c / 2 >= MIN_SLAB_COLUMNS divides f."""
  itemsize = jnp.dtype(w_dtype).itemsize
  c = (SLAB_ROW_BYTES_INT8 if itemsize == 1 else SLAB_ROW_BYTES) // itemsize
  while 2 * slots * (f // c) <= WAVE_PROGRAMS and c // 2 >= MIN_SLAB_COLUMNS and f % (c // 2) == 0:
    c //= 2
  return c


def fits(m: int, d: int, f: int, w_dtype, gated: bool, slots: int = 1) -> bool:
  """Whether the one-kernel form takes this feed-forward: one row; d a multiple of 16 in at most MAX_PIECES
  power-of-two pieces (Triton blocks); f a multiple of the slab (slab_columns); a program's (2 + gated) slabs of
  d x c within MAX_PROGRAM_BYTES; and at least MIN_PROGRAMS programs."""
  c = slab_columns(w_dtype, f, slots)
  return (m == 1 and d >= 16 and d % 16 == 0 and len(whole_row.pieces(d)) <= MAX_PIECES and f % c == 0
          and slots * (f // c) >= MIN_PROGRAMS
          and (2 + gated) * d * c * jnp.dtype(w_dtype).itemsize <= MAX_PROGRAM_BYTES)


@dataclasses.dataclass(frozen=True)
class Routed:
  """The row kernel routes itself: `experts` is the token's router partial logits [1, splits, E], slot s's expert
  its s-th largest logit (decode_router's own rule, so every program gets the same ids), and programs (s, 0) store
  its id and, after their slab, its weight (decode_router.triton.weights_of). Taken there, the weights' softmax
  is off every other program's path: in the epilogue's 32 programs it ran 2.4 us against 1.9 and the medium-MoE
  step 1.1-2.2% slower (experiments/results/decode_select_in_experts_weights_ab_H100.log)."""
  k: int
  renormalize: bool


def _pick(values: list, s):
  """values[s] for a traced slot index s over a static list."""
  v = values[0]
  for i in range(1, len(values)):
    v = jnp.where(s == i, values[i], v)
  return v


def _total(values: list):
  """The sum of a list of arrays, with no zero to start it (one piece lowers as it did before pieces)."""
  return functools.reduce(operator.add, values)


def _kernel(experts_ref, *refs, source, activation: Callable, dtype, c: int, gated: bool, up_scaled: bool,
            gate_scaled: bool, routed: Routed | None):
  refs = list(refs)
  x_refs = [refs.pop(0) for _ in range(1 if not isinstance(source, Normed) else 2)]
  w_in_ref = refs.pop(0)
  w_gate_ref = refs.pop(0) if gated else None
  w_out_ref = refs.pop(0)
  s_in_ref = refs.pop(0) if up_scaled else None
  s_gate_ref = refs.pop(0) if gate_scaled else None
  out_ref, *routed_refs = refs
  s, j = pl.program_id(0), pl.program_id(1)
  if routed:
    logits = summed_logits(experts_ref, 0, experts_ref.shape[1])
    ids = top_ids(logits, routed.k)
    e = _pick(ids, s)
  else:
    e = experts_ref[s]
  present = (e >= 0) & (e < w_in_ref.shape[0])  # a slot with no expert reads nothing and writes zeros
  expert = jnp.clip(e, 0, w_in_ref.shape[0] - 1)
  cols = pl.ds(pl.multiple_of(j * c, c), c)
  f32 = lambda v: v.astype(jnp.float32)
  rnd = lambda v: v.astype(dtype).astype(jnp.float32)
  # Weights enter as x's dtype: int8 exactly, so straight to float32, by float bits (weights_as).
  wf = lambda w: weights_as(w, jnp.float32) if w.dtype == jnp.int8 else rnd(w)
  d = kn(w_out_ref)[1]
  km = k_major(w_in_ref.dtype)  # int8: W_in's slab is [c, d] and W_out's [d, c], summed over their last axis
  # d in power-of-two pieces (whole_row.pieces; one piece, the whole row, where d is a power of two): every
  # load, product and store along d runs piece by piece, so no register holds padding.
  pieces = whole_row.pieces(d)
  at = [whole_row.piece_index(d, p) for p in pieces]

  def part(_):
    w2 = [w_out_ref[expert, i, cols] if km else w_out_ref[expert, cols, i] for i in at]
    w1 = [w_in_ref[expert, cols, i] if km else w_in_ref[expert, i, cols] for i in at]
    wg = [w_gate_ref[expert, cols, i] if km else w_gate_ref[expert, i, cols] for i in at] if gated else None
    if isinstance(source, Normed):
      x = [x_refs[0][0, i] for i in at]
      xs = [f32((f32(xp) * f32(x_refs[1][i])).astype(xp.dtype)) for xp, i in zip(x, at)]
      r = jax.lax.rsqrt(_total([jnp.sum(f32(xp) * f32(xp)) for xp in x]) / d + source.eps)
    else:
      x_ref = x_refs[0]
      xs, r = [f32(x_ref[s, 0, i] if source.per_slot else x_ref[0, i]) for i in at], None

    def first(w, scale_ref):
      v = _total([jnp.sum(xp[None, :] * wf(wp), axis=1) if km else jnp.sum(xp[:, None] * wf(wp), axis=0)
                 for xp, wp in zip(xs, w)])
      if r is not None:
        v = v * r
      if scale_ref is not None:
        v = v * f32(scale_ref[expert, cols])
      return rnd(v)

    u = first(w1, s_in_ref)
    h = rnd(activation(first(wg, s_gate_ref)) * u if gated else activation(u))
    return [jnp.sum(h[None, :] * wf(wp), axis=1) if km else jnp.sum(h[:, None] * wf(wp), axis=0) for wp in w2]

  # A branch, not a zero trip count (triton.py's _kernel says why).
  nothing = lambda _: [jnp.zeros((size,), jnp.float32) for _, size in pieces]
  for i, v in zip(at, jax.lax.cond(present, part, nothing, None)):
    out_ref[s, j, i] = v
  if routed:  # after the slab's work: the weights' softmax stays off the weight stream's path

    @pl.when(j == 0)
    def _():
      routed_refs[0][s] = e
      routed_refs[1][s] = _pick(weights_of(logits, ids, routed.renormalize), s)


@shared_lowering("source", "activation", "dtype", "routed")
def row_ffn_parts(
    x_operands: tuple,
    source,
    w_in: Num[Array, "experts d f"],
    w_gate: Num[Array, "experts d f"] | None,
    w_out: Num[Array, "experts f d"],
    s_in: Float[Array, "experts f"] | None,
    s_gate: Float[Array, "experts f"] | None,
    experts: Int[Array, "slots"] | Float[Array, "1 splits experts"],
    activation: Callable,
    dtype,
    routed: Routed | None = None,
    *,
    interpret: bool,
) -> Float[Array, "slots programs d"] | tuple:
  """The module docstring's parts, float32 and unscaled by W_out's scale: FFN_s(x) = sum_j parts[s, j].

  x_operands are what `source` reads: (x,) for triton.Plain (x [1, d], or [slots, 1, d] per slot), (x, g)
  for Normed. activation is a kernel-body function (sparsejax.activations.PLAIN); dtype is x's (the
  rounding of u, g and h). routed (Routed): `experts` is the router's partial logits of the token
  (decode_router.router_logit_parts) and slot s's expert its s-th choice, which every program takes itself
  (the router's select kernel then never runs); the result is (parts, the k ids, their float32 weights)."""
  d, f = kn(w_in)
  slots = routed.k if routed else experts.shape[0]
  c = slab_columns(w_in.dtype, f, slots)
  gated, up_scaled, gate_scaled = w_gate is not None, s_in is not None, s_gate is not None
  kernel = functools.partial(_kernel, source=source, activation=activation, dtype=jnp.dtype(dtype), c=c,
                             gated=gated, up_scaled=up_scaled, gate_scaled=gate_scaled, routed=routed)
  operands = tuple(x_operands) + tuple(w for w in (w_in, w_gate, w_out, s_in, s_gate) if w is not None)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
  out_shape = jax.ShapeDtypeStruct((slots, f // c, d), jnp.float32)
  if routed:
    out_shape = (out_shape, jax.ShapeDtypeStruct((slots,), jnp.int32), jax.ShapeDtypeStruct((slots,), jnp.float32))
  return launch_dependents.pallas_call(
      kernel,
      grid=(slots, f // c),
      in_specs=[pl.no_block_spec] * (1 + len(operands)),
      out_specs=(pl.no_block_spec,) * len(out_shape) if routed else pl.no_block_spec,
      out_shape=out_shape,
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_row_ffn",
  )(experts if routed else experts.astype(jnp.int32), *operands)


# The epilogue kernel's columns a program owns: d / 32 programs, each summing [P, 32] float32 a slot (16 KB at
# P = 128), all loads issued at once. 16 and 8 (64 and 128 programs) ran the medium-MoE step 0.994x and 0.995x,
# rounds on both sides of 1 (experiments/results/decode_epilogue_columns_ab_H100.log): no reason to change.
EPILOGUE_COLUMNS = 32


def epilogue_fits(d: int, programs: int) -> bool:
  """Whether residual_epilogue takes the parts: d a multiple of its column block, and P in at most MAX_PIECES
  power-of-two pieces (whole_row.pieces)."""
  return len(whole_row.pieces(programs)) <= MAX_PIECES and d % EPILOGUE_COLUMNS == 0


def _epilogue_kernel(experts_ref, parts_ref, combine_ref, residual_ref, *refs, dtype, bd: int, scaled: bool,
                     num_experts: int):
  s_out_ref = refs[0] if scaled else None
  out_ref = refs[-1]
  cols = pl.ds(pl.multiple_of(pl.program_id(0) * bd, bd), bd)
  rnd = lambda v: v.astype(dtype).astype(jnp.float32)
  z = jnp.zeros((bd,), jnp.float32)
  programs = parts_ref.shape[1]
  for s in range(parts_ref.shape[0]):  # the slots: static and few (one token's k)
    # P in power-of-two pieces (small-moe's 192 programs: 128 + 64), each a block of its own
    y = _total([jnp.sum(parts_ref[s, whole_row.piece_index(programs, p), cols], axis=0)
                for p in whole_row.pieces(programs)])
    e = experts_ref[s]
    if scaled:
      y = y * s_out_ref[jnp.clip(e, 0, num_experts - 1), cols].astype(jnp.float32)  # no expert: zero parts
    # A slot with no expert adds nothing whatever its weight (the caller passes the router's weights unmasked).
    c = jnp.where((e >= 0) & (e < num_experts), combine_ref[0, s].astype(jnp.float32), 0.0)
    z = z + c * rnd(y)
  out_ref[0, cols] = (residual_ref[0, cols].astype(jnp.float32) + rnd(z)).astype(out_ref.dtype)


def residual_epilogue(
    parts: Float[Array, "slots programs d"],
    combine: Float[Array, "1 slots"],
    residual: Float[Array, "1 d"],
    s_out: Float[Array, "experts d"] | None,
    experts: Int[Array, "slots"],
    dtype,
    num_experts: int,
    *,
    interpret: bool,
) -> Float[Array, "1 d"]:
  """residual + round(sum_s [0 <= experts[s] < num_experts] combine[0, s] round(sum_j parts[s, j] (* s_out[experts[s]]))),
  in residual's dtype; round is to dtype (the FFN input's). What XLA ran as a reduction kernel then the layer's
  add, as one kernel of d / EPILOGUE_COLUMNS programs (op.skinny_ffn_residual; its reference is
  op._residual_epilogue_reference). EPILOGUE_COLUMNS is read here, outside the shared lowering, so a changed
  value lowers anew."""
  return _residual_epilogue(parts, combine, residual, s_out, experts, dtype, num_experts, EPILOGUE_COLUMNS,
                            interpret=interpret)


@shared_lowering("dtype", "num_experts", "bd")
def _residual_epilogue(parts, combine, residual, s_out, experts, dtype, num_experts: int, bd: int, *,
                       interpret: bool):
  d = parts.shape[-1]
  scaled = s_out is not None
  kernel = functools.partial(_epilogue_kernel, dtype=jnp.dtype(dtype), bd=bd, scaled=scaled,
                             num_experts=num_experts)
  operands = (experts.astype(jnp.int32), parts, combine.astype(jnp.float32), residual) + ((s_out,) if scaled else ())
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=4, num_stages=1)
  return launch_dependents.pallas_call(
      kernel,
      grid=(d // bd,),
      in_specs=[pl.no_block_spec] * len(operands),
      out_specs=pl.no_block_spec,
      out_shape=jax.ShapeDtypeStruct((1, d), residual.dtype),
      interpret=interpret,
      compiler_params=params,
      name="sparsejax_row_ffn_epilogue",
  )(*operands)
