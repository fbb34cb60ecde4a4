"""block_moves as one Pallas Triton kernel: each expert's threshold found by bisection, in registers.

Token rounding moves fewer than b of an expert's items: its r lowest assignments, or its b - r likeliest
candidates. The reference ranks all T k + T items with one sort, which XLA runs as many kernels (about 0.1 ms
of rounding's 0.14 at E64 top-1 on an H200, fifty-third session). Here one program per expert reads that
expert's row of a [E, T] key table (p[t, e]'s bits; the sign bit marks a candidate) and counts: its assignments
and candidates, hence the direction and n; then the n-th item in selection order by bisection, on the score's 31
bits and then on the token among ties. A bisection step is a compare and a sum over the row, held in registers
where it fits. The kernel writes each expert's (mode, score, token) threshold; an XLA fusion compares every item
with its expert's. Reference: reference.py (op.block_moves' contract). Off the GPU: interpret mode (tests).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from sparsejax.kernels.shared_lowering import shared_lowering

NONE = 0x7FFFFFFF  # a (token, expert) pair that is neither an assignment nor a candidate; above every score's bits
SIGN = -0x80000000  # set on a candidate's key
DOWN, UP = 1, 2  # modes: the n selected are dropped assignments, or added candidates


@dataclasses.dataclass(frozen=True)
class Config:
  """A program holds `chunk` keys at a time (a power of two); rows longer than that are read again each step."""
  chunk: int = 16384
  num_warps: int = 16


def _kernel(keys_ref, mode_ref, v_ref, i_ref, *, block: int, chunk: int):
  tp = keys_ref.shape[1]
  chunks = tp // chunk

  def at(c):
    return keys_ref[0, pl.ds(c * chunk, chunk)], c * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)

  if chunks == 1:
    x0, t0 = at(0)
    total = lambda f: jnp.sum(f(x0, t0).astype(jnp.int32))
  else:
    def total(f):
      return jax.lax.fori_loop(0, chunks, lambda c, acc: acc + jnp.sum(f(*at(c)).astype(jnp.int32)), jnp.int32(0))

  assigned = lambda x: (x >= 0) & (x != NONE)
  c = total(lambda x, t: assigned(x))
  cand = total(lambda x, t: x < 0)
  rem = jax.lax.rem(c, block)
  moves = (c >= block) & (rem > 0)
  up = moves & (2 * rem >= block) & (cand >= block - rem)
  # Constants in a where are typed: Pallas Triton's select lowering gives a weakly typed literal the predicate's
  # type (bool), so jnp.where(up, 2, 1) would compile to where(up, 0, 1).
  zero = jnp.int32(0)
  n = jnp.where(up, block - rem, jnp.where(moves, rem, zero))

  def order(x, t):
    """(member, u, tt): the selection takes the n members of smallest u, ties to the larger tt. Down: u = p's bits,
    tt = t (the higher token dropped first). Up: u = NONE - bits and tt = tp - 1 - t (likeliest, lower token first)."""
    s = x & NONE
    return (jnp.where(up, x < 0, assigned(x)), jnp.where(up, NONE - s, s), jnp.where(up, (tp - 1) - t, t))

  counted = lambda f: total(lambda x, t: f(*order(x, t)))  # #{members with f(member, u, tt)}

  def score_step(_, lohi):  # the least v with #{u <= v} >= n
    lo, hi = lohi
    mid = lo + jax.lax.div(hi - lo, 2)
    cnt = counted(lambda m, u, tt: m & (u <= mid))
    return jnp.where(cnt >= n, lo, mid + 1), jnp.where(cnt >= n, mid, hi)

  v, _ = jax.lax.fori_loop(0, 31, score_step, (jnp.int32(0), jnp.int32(NONE)))
  j = n - counted(lambda m, u, tt: m & (u < v))  # the ties at v still to take

  def token_step(_, lohi):  # the greatest i with #{u == v, tt >= i} >= j
    lo, hi = lohi
    mid = lo + jax.lax.div(hi - lo + 1, 2)
    cnt = counted(lambda m, u, tt: m & (u == v) & (tt >= mid))
    return jnp.where(cnt >= j, mid, lo), jnp.where(cnt >= j, hi, mid - 1)

  i, _ = jax.lax.fori_loop(0, max(tp.bit_length() - 1, 0), token_step, (jnp.int32(0), jnp.int32(tp - 1)))
  mode_ref[...] = jnp.full((1,), jnp.where(n > 0, jnp.where(up, jnp.int32(UP), jnp.int32(DOWN)), zero), jnp.int32)
  v_ref[...] = jnp.full((1,), v, jnp.int32)
  i_ref[...] = jnp.full((1,), i, jnp.int32)


@shared_lowering("num_experts", "block", "cfg")
def thresholds(keys: Int[Array, "experts tp"], num_experts: int, block: int, cfg: Config = Config(), *,
               interpret: bool = False) -> tuple[Int[Array, "experts"], Int[Array, "experts"], Int[Array, "experts"]]:
  """Each expert's (mode, v, i): its selection is the members with u < v, or u == v and tt >= i (_kernel)."""
  tp = keys.shape[1]
  chunk = min(cfg.chunk, tp)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1)
  out = jax.ShapeDtypeStruct((num_experts,), jnp.int32)
  return pl.pallas_call(
      functools.partial(_kernel, block=block, chunk=chunk),
      grid=(num_experts,),
      in_specs=[pl.BlockSpec((1, tp), lambda e: (e, 0))],
      out_specs=[pl.BlockSpec((1,), lambda e: (e,))] * 3,
      out_shape=[out] * 3, interpret=interpret, compiler_params=params, name="sparsejax_block_moves",
  )(keys)


def block_moves(probs: Float[Array, "tokens experts"], expert: Int[Array, "tokens k"], nxt: Int[Array, "tokens"],
                block: int, cfg: Config = Config(), *, interpret: bool = False
                ) -> tuple[Bool[Array, "tokens k"], Bool[Array, "tokens"]]:
  """(keep, add) of op.block_moves: the key table in one XLA fusion, the thresholds by the kernel, then one compare
  per item. probs: float32 without -0.0."""
  num_tokens, num_experts = probs.shape
  tp = pl.next_power_of_2(num_tokens)
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)  # >= 0, ordered as the probabilities
  experts = jnp.arange(num_experts, dtype=jnp.int32)
  assigned = jnp.any(expert[:, :, None] == experts, axis=1)
  key = jnp.where(assigned, bits, jnp.where(nxt[:, None] == experts, bits | SIGN, NONE))
  keys = jnp.pad(key.T, ((0, 0), (0, tp - num_tokens)), constant_values=NONE)
  mode, v, i = thresholds(keys, num_experts, block, cfg, interpret=interpret)
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  valid = expert < num_experts
  ec = jnp.minimum(expert, num_experts - 1)
  s = jnp.take_along_axis(bits, ec, axis=1)
  dropped = (mode[ec] == DOWN) & ((s < v[ec]) | ((s == v[ec]) & (t[:, None] >= i[ec])))
  nc = jnp.minimum(nxt, num_experts - 1)
  u = NONE - jnp.take_along_axis(bits, nc[:, None], axis=1)[:, 0]
  added = (mode[nc] == UP) & ((u < v[nc]) | ((u == v[nc]) & (tp - 1 - t >= i[nc])))
  return valid & ~dropped, (nxt < num_experts) & added
