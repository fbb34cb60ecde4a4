"""block_moves' reference: each expert's assignments and candidates ranked by one stable sort in XLA ops."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def move_counts(counts: Int[Array, "experts"], candidates: Int[Array, "experts"], block: int
                ) -> tuple[Int[Array, "experts"], Int[Array, "experts"]]:
  """(keep_n, add_n): with r = c mod b, an expert with c >= b and r > 0 adds b - r when 2 r >= b and at least
  b - r candidates have it next, else keeps c - r; any other expert keeps c and adds none."""
  rem = counts % block
  moves = (counts >= block) & (rem > 0)
  up = moves & (2 * rem >= block) & (candidates >= block - rem)
  return jnp.where(moves & ~up, counts - rem, counts), jnp.where(up, block - rem, 0)


def ranks_within(keys: Int[Array, "n"], scores: Float[Array, "n"], num_keys: int) -> Int[Array, "n"]:
  """Position of each item among the items of its key, by score descending, ties to the lower index.

  One stable two-key sort carrying the index (on a GPU the sort is most of this function's cost)."""
  n = keys.shape[0]
  index = jnp.arange(n, dtype=jnp.int32)
  _, _, order = jax.lax.sort((keys, -scores, index), num_keys=2, is_stable=True)
  position = jnp.zeros((n,), jnp.int32).at[order].set(index)
  counts = jnp.zeros((num_keys,), jnp.int32).at[keys].add(1)
  starts = jnp.cumsum(counts) - counts
  return position - starts[keys]


def block_moves_reference(probs: Float[Array, "tokens experts"], expert: Int[Array, "tokens k"],
                          nxt: Int[Array, "tokens"], block: int) -> tuple[Bool[Array, "tokens k"], Bool[Array, "tokens"]]:
  """(keep, add) of op.block_moves: ranks within each expert by one sort, against move_counts' keep_n and add_n."""
  num_tokens, num_experts = probs.shape
  valid = expert < num_experts
  e = jnp.where(valid, expert, num_experts)
  counts = jnp.zeros((num_experts + 1,), jnp.int32).at[e.reshape(-1)].add(1)[:num_experts]
  candidates = jnp.zeros((num_experts + 1,), jnp.int32).at[nxt].add(1)[:num_experts]
  keep_n, add_n = move_counts(counts, candidates, block)
  picked = jnp.take_along_axis(probs, jnp.minimum(e, num_experts - 1), axis=1)
  nxt_p = jnp.take_along_axis(probs, jnp.minimum(nxt, num_experts - 1)[:, None], axis=1)[:, 0]
  # The assignments ranked within their expert and the candidates within theirs, in one sort.
  ranks = ranks_within(jnp.concatenate([e.reshape(-1), nxt + num_experts + 1]),
                       jnp.concatenate([picked.reshape(-1), nxt_p]), 2 * num_experts + 2)
  rank, add_rank = ranks[:e.size].reshape(e.shape), ranks[e.size:]
  with_none = lambda a: jnp.concatenate([a, jnp.zeros((1,), a.dtype)])  # index E: not an expert
  keep = valid & (rank < with_none(keep_n)[e])
  add = (nxt < num_experts) & (add_rank < with_none(add_n)[nxt])
  return keep, add
