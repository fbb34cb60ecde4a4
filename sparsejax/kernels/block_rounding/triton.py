"""block_moves as Pallas Triton kernels: each expert's threshold found by bisection, in registers.

Token rounding moves fewer than b of an expert's items: its r lowest assignments, or its b - r likeliest
candidates. The reference ranks all T k + T items with one sort, which XLA runs as many kernels (about 0.1 ms
of rounding's 0.14 at E64 top-1 on an H200, fifty-third session). Here one program per expert reads that
expert's row of a [E, T] key table (p[t, e]'s bits; the sign bit marks a candidate) and counts: its assignments
and candidates, hence the direction and n; then the n-th item in selection order by bisection, on the score's 31
bits and then on the token among ties. A bisection step is a compare and a sum over the row, held in registers
where it fits. The kernel writes each expert's (mode, score, token) threshold; an XLA fusion compares every item
with its expert's.

Under an axis (group_moves) the direction comes from the group's counts (two psums), and two kernels replace the
reference's two sorts: one selects and compacts each device's first b items of every expert in selection order,
the other finds the group's n-th among the b items every device sent (all_gather).
Reference: reference.py (op.block_moves' contract). Off the GPU: interpret mode (tests).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from sparsejax.kernels.block_rounding.reference import move_counts
from sparsejax.kernels.shared_lowering import shared_lowering

NONE = 0x7FFFFFFF  # a (token, expert) pair that is neither an assignment nor a candidate; above every score's bits
SIGN = -0x80000000  # set on a candidate's key
DOWN, UP = 1, 2  # modes: the n selected are dropped assignments, or added candidates


@dataclasses.dataclass(frozen=True)
class Config:
  """A program holds `chunk` keys at a time (a power of two); rows longer than that are read again each step."""
  chunk: int = 16384
  num_warps: int = 16


def _row(refs, chunk: int):
  """(at, total) over the program's row of each ref: at(c) = chunk c's values and positions; total(f) = the number
  of positions where f(*values, position) holds, the row held in registers whole or read chunk by chunk."""
  chunks = refs[0].shape[0] // chunk

  def at(c):
    return (*(r[pl.ds(c * chunk, chunk)] for r in refs), c * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0))

  if chunks == 1:
    whole = at(0)
    return at, lambda f: jnp.sum(f(*whole).astype(jnp.int32))
  return at, lambda f: jax.lax.fori_loop(
      0, chunks, lambda c, acc: acc + jnp.sum(f(*at(c)).astype(jnp.int32)), jnp.int32(0))


def _threshold(counted, n, tt_max: int):
  """(v, i): the n members of smallest u, ties to the larger tt, are the members with u < v, or u == v and
  tt >= i (all members when fewer than n). counted(f) = #{members with f(u, tt)}; u in [0, NONE], tt in
  [0, tt_max]."""
  def score_step(_, lohi):  # the least v with #{u <= v} >= n
    lo, hi = lohi
    mid = lo + jax.lax.div(hi - lo, 2)
    cnt = counted(lambda u, tt: u <= mid)
    return jnp.where(cnt >= n, lo, mid + 1), jnp.where(cnt >= n, mid, hi)

  v, _ = jax.lax.fori_loop(0, 31, score_step, (jnp.int32(0), jnp.int32(NONE)))
  j = n - counted(lambda u, tt: u < v)  # the ties at v still to take

  def token_step(_, lohi):  # the greatest i with #{u == v, tt >= i} >= j
    lo, hi = lohi
    mid = lo + jax.lax.div(hi - lo + 1, 2)
    cnt = counted(lambda u, tt: (u == v) & (tt >= mid))
    return jnp.where(cnt >= j, mid, lo), jnp.where(cnt >= j, hi, mid - 1)

  i, _ = jax.lax.fori_loop(0, tt_max.bit_length(), token_step, (jnp.int32(0), jnp.int32(tt_max)))
  return v, i


def _order(x, t, up, tp: int):
  """(member, u, tt) of a key x at token t: the selection takes the n members of smallest u, ties to the larger tt.
  Down: assignments, u = p's bits, tt = t (the higher token dropped first). Up: candidates, u = NONE - bits and
  tt = tp - 1 - t (likeliest, lower token first)."""
  s = x & NONE
  assigned = (x >= 0) & (x != NONE)
  return jnp.where(up, x < 0, assigned), jnp.where(up, NONE - s, s), jnp.where(up, (tp - 1) - t, t)


def _counted(total, up, tp: int):
  """counted(f) = #{members with f(u, tt)} of a key-table row (_order), for _threshold."""
  def counted(f):
    def g(x, t):
      m, u, tt = _order(x, t, up, tp)
      return m & f(u, tt)
    return total(g)
  return counted


def _moves_kernel(keys_ref, mode_ref, v_ref, i_ref, *, block: int, chunk: int):
  """One expert's direction, n and threshold from its row of the key table."""
  tp = keys_ref.shape[0]
  _, total = _row((keys_ref,), chunk)
  c = total(lambda x, t: (x >= 0) & (x != NONE))
  cand = total(lambda x, t: x < 0)
  rem = jax.lax.rem(c, block)
  moves = (c >= block) & (rem > 0)
  up = moves & (2 * rem >= block) & (cand >= block - rem)
  # Constants in a where are typed: Pallas Triton's select lowering gives a weakly typed literal the predicate's
  # type (bool), so jnp.where(up, 2, 1) would compile to where(up, 0, 1).
  zero = jnp.int32(0)
  n = jnp.where(up, block - rem, jnp.where(moves, rem, zero))

  v, i = _threshold(_counted(total, up, tp), n, tp - 1)
  mode_ref[...] = jnp.full((1,), jnp.where(n > 0, jnp.where(up, jnp.int32(UP), jnp.int32(DOWN)), zero), jnp.int32)
  v_ref[...] = jnp.full((1,), v, jnp.int32)
  i_ref[...] = jnp.full((1,), i, jnp.int32)


def _first_kernel(keys_ref, mode_ref, u_ref, t_ref, count_ref, *, depth: int, chunk: int):
  """One expert's first `depth` members in the given mode's selection order (all when fewer), compacted in token
  order: u_ref[:count] their u, t_ref[:count] their tokens; the slots past count are not written."""
  from jax.experimental.pallas import triton as plt
  tp = keys_ref.shape[0]
  at, total = _row((keys_ref,), chunk)
  mode = jnp.max(mode_ref[...])
  up = mode == UP
  n = jnp.where(mode > 0, jnp.int32(depth), jnp.int32(0))

  v, i = _threshold(_counted(total, up, tp), n, tp - 1)

  def put(c, base):
    x, t = at(c)
    m, u, tt = _order(x, t, up, tp)
    sel = m & ((u < v) | ((u == v) & (tt >= i))) & (n > 0)
    # An unselected lane's slot is past the output, distinct from every other's, so its masked store touches
    # nothing in interpret mode either (which stores the old value back where the mask is off).
    slot = jnp.where(sel, base + jnp.cumsum(sel.astype(jnp.int32)) - 1, depth + t)
    plt.store(u_ref.at[slot], u, mask=sel)
    plt.store(t_ref.at[slot], t, mask=sel)
    return base + jnp.sum(sel.astype(jnp.int32))

  count = jax.lax.fori_loop(0, tp // chunk, put, jnp.int32(0))
  count_ref[...] = jnp.full((1,), count, jnp.int32)


def _nth_kernel(u_ref, tt_ref, n_ref, v_ref, i_ref, *, tt_max: int):
  """One expert's threshold at its n over a row of explicit (u, tt); members are the slots with tt >= 0."""
  _, total = _row((u_ref, tt_ref), u_ref.shape[0])
  n = jnp.max(n_ref[...])
  v, i = _threshold(lambda f: total(lambda u, tt, _: (tt >= 0) & f(u, tt)), n, tt_max)
  v_ref[...] = jnp.full((1,), v, jnp.int32)
  i_ref[...] = jnp.full((1,), i, jnp.int32)


def _params(cfg: Config, interpret: bool):
  if interpret:
    return None
  from jax.experimental.pallas import triton as plt
  return plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1)


def _row_spec(width: int):
  return pl.BlockSpec((None, width), lambda e: (e, 0))


_ONE = pl.BlockSpec((1,), lambda e: (e,))


@shared_lowering("num_experts", "block", "cfg")
def thresholds(keys: Int[Array, "experts tp"], num_experts: int, block: int, cfg: Config = Config(), *,
               interpret: bool = False) -> tuple[Int[Array, "experts"], Int[Array, "experts"], Int[Array, "experts"]]:
  """Each expert's (mode, v, i): its selection is the members with u < v, or u == v and tt >= i (_order)."""
  tp = keys.shape[1]
  out = jax.ShapeDtypeStruct((num_experts,), jnp.int32)
  return pl.pallas_call(
      functools.partial(_moves_kernel, block=block, chunk=min(cfg.chunk, tp)),
      grid=(num_experts,), in_specs=[_row_spec(tp)], out_specs=[_ONE] * 3, out_shape=[out] * 3,
      interpret=interpret, compiler_params=_params(cfg, interpret), name="sparsejax_block_moves",
  )(keys)


@shared_lowering("depth", "cfg")
def first_members(keys: Int[Array, "experts tp"], mode: Int[Array, "experts"], depth: int, cfg: Config = Config(),
                  *, interpret: bool = False
                  ) -> tuple[Int[Array, "experts depth"], Int[Array, "experts depth"], Int[Array, "experts"]]:
  """(u, t, count): each expert's first min(depth, members) members in its mode's selection order (_order; none
  for mode 0), in token order; slots at or past count hold garbage."""
  num_experts, tp = keys.shape
  rows = jax.ShapeDtypeStruct((num_experts, depth), jnp.int32)
  return pl.pallas_call(
      functools.partial(_first_kernel, depth=depth, chunk=min(cfg.chunk, tp)),
      grid=(num_experts,), in_specs=[_row_spec(tp), _ONE], out_specs=[_row_spec(depth)] * 2 + [_ONE],
      out_shape=[rows, rows, jax.ShapeDtypeStruct((num_experts,), jnp.int32)],
      interpret=interpret, compiler_params=_params(cfg, interpret), name="sparsejax_block_moves_first",
  )(keys, mode)


@shared_lowering("tt_max", "cfg")
def nth_thresholds(u: Int[Array, "experts width"], tt: Int[Array, "experts width"], n: Int[Array, "experts"],
                   tt_max: int, cfg: Config = Config(), *, interpret: bool = False
                   ) -> tuple[Int[Array, "experts"], Int[Array, "experts"]]:
  """Each row's (v, i) at its n (_threshold): members are the slots with tt >= 0; width a power of two."""
  num_experts, width = u.shape
  out = jax.ShapeDtypeStruct((num_experts,), jnp.int32)
  return pl.pallas_call(
      functools.partial(_nth_kernel, tt_max=tt_max),
      grid=(num_experts,), in_specs=[_row_spec(width)] * 2 + [_ONE], out_specs=[_ONE] * 2, out_shape=[out] * 2,
      interpret=interpret, compiler_params=_params(cfg, interpret), name="sparsejax_block_moves_nth",
  )(u, tt, n)


def _key_table(probs, expert, nxt):
  """(bits, keys, assigned, candidate): p's bits [T, E]; the [E, T_pow2] key table (a candidate's key with the
  sign bit; NONE for a pair that is neither, and for the padding); and the [T, E] masks it was built from."""
  num_tokens, num_experts = probs.shape
  tp = pl.next_power_of_2(num_tokens)
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)  # >= 0, ordered as the probabilities
  experts = jnp.arange(num_experts, dtype=jnp.int32)
  assigned = jnp.any(expert[:, :, None] == experts, axis=1)
  candidate = nxt[:, None] == experts
  key = jnp.where(assigned, bits, jnp.where(candidate, bits | SIGN, NONE))
  return bits, jnp.pad(key.T, ((0, 0), (0, tp - num_tokens)), constant_values=NONE), assigned, candidate


def _apply(bits, expert, nxt, mode, v, i, token, tt_max):
  """(keep, add): every item compared with its expert's threshold; token: the items' tokens in the thresholds'
  numbering, tt_max + 1 of them."""
  num_experts = bits.shape[1]
  ec = jnp.minimum(expert, num_experts - 1)
  s = jnp.take_along_axis(bits, ec, axis=1)
  dropped = (mode[ec] == DOWN) & ((s < v[ec]) | ((s == v[ec]) & (token[:, None] >= i[ec])))
  nc = jnp.minimum(nxt, num_experts - 1)
  u = NONE - jnp.take_along_axis(bits, nc[:, None], axis=1)[:, 0]
  added = (mode[nc] == UP) & ((u < v[nc]) | ((u == v[nc]) & (tt_max - token >= i[nc])))
  return (expert < num_experts) & ~dropped, (nxt < num_experts) & added


def block_moves(probs: Float[Array, "tokens experts"], expert: Int[Array, "tokens k"], nxt: Int[Array, "tokens"],
                block: int, cfg: Config = Config(), *, interpret: bool = False
                ) -> tuple[Bool[Array, "tokens k"], Bool[Array, "tokens"]]:
  """(keep, add) of op.block_moves: the key table in one XLA fusion, the thresholds by the kernel, then one compare
  per item. probs: float32 without -0.0."""
  num_tokens, num_experts = probs.shape
  bits, keys, _, _ = _key_table(probs, expert, nxt)
  mode, v, i = thresholds(keys, num_experts, block, cfg, interpret=interpret)
  tp = keys.shape[1]
  return _apply(bits, expert, nxt, mode, v, i, jnp.arange(num_tokens, dtype=jnp.int32), tp - 1)


def group_moves(probs: Float[Array, "tokens experts"], expert: Int[Array, "tokens k"], nxt: Int[Array, "tokens"],
                block: int, axis_name, cfg: Config = Config(), *, interpret: bool = False
                ) -> tuple[Bool[Array, "tokens k"], Bool[Array, "tokens"]]:
  """(keep, add) of op.block_moves with axis_name. The group's counts (psums) give each expert's mode and n < b;
  each device sends its first b members of every expert in that order (first_members; b rounded up to a power of
  two; an all_gather of 2 E b ints), and the group's n-th among them (nth_thresholds) is the group's n-th. Ties go by the group's token,
  device index * T + t."""
  num_tokens, num_experts = probs.shape
  bits, keys, assigned, candidate = _key_table(probs, expert, nxt)
  local = jnp.stack([jnp.sum(assigned, axis=0, dtype=jnp.int32), jnp.sum(candidate, axis=0, dtype=jnp.int32)])
  counts, candidates = jax.lax.psum(local, axis_name)
  keep_n, add_n = move_counts(counts, candidates, block)
  zero = jnp.zeros((), jnp.int32)
  mode = jnp.where(add_n > 0, UP, jnp.where(counts > keep_n, DOWN, zero)).astype(jnp.int32)
  n = jnp.where(add_n > 0, add_n, counts - keep_n).astype(jnp.int32)
  depth = pl.next_power_of_2(block)  # a Triton block's width; n < b <= depth
  u, t, count = first_members(keys, mode, depth, cfg, interpret=interpret)
  size = jax.lax.axis_size(axis_name)
  me = jax.lax.axis_index(axis_name).astype(jnp.int32)
  tt_max = size * num_tokens - 1
  token = me * num_tokens + t  # the group's numbering
  sent = jnp.arange(depth, dtype=jnp.int32) < count[:, None]
  tt = jnp.where(sent, jnp.where((mode == UP)[:, None], tt_max - token, token), -1)
  # Every device's rows side by side, [2, E, devices * b], padded to a power of two with non-members.
  rows = jnp.moveaxis(jax.lax.all_gather(jnp.stack([u, tt]), axis_name), 0, 2).reshape(2, num_experts, size * depth)
  width = pl.next_power_of_2(size * depth)
  rows = jnp.pad(rows, ((0, 0), (0, 0), (0, width - size * depth)), constant_values=-1)
  v, i = nth_thresholds(rows[0], rows[1], n, tt_max, cfg, interpret=interpret)
  return _apply(bits, expert, nxt, mode, v, i, me * num_tokens + jnp.arange(num_tokens, dtype=jnp.int32), tt_max)
