"""block_moves' reference: each expert's assignments and candidates ranked by one stable sort in XLA ops; under an
axis, each device's by one sort and the group's n-th item by a sort of what every device sends."""
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


def _with_none(a):
  """a with a 0 at index E (E: not an expert)."""
  return jnp.concatenate([a, jnp.zeros((1,), a.dtype)])


def _ranked(probs, expert, nxt):
  """(valid, e, counts, candidates, picked, nxt_p, rank, add_rank) of this device's items: e the assignments'
  experts (E for none); each expert's assignments and candidates; the items' probabilities; and each item's rank
  within its expert by probability, descending, ties to the lower index: the assignments and the candidates
  ranked in one sort."""
  num_experts = probs.shape[1]
  valid = expert < num_experts
  e = jnp.where(valid, expert, num_experts)
  counts = jnp.zeros((num_experts + 1,), jnp.int32).at[e.reshape(-1)].add(1)[:num_experts]
  candidates = jnp.zeros((num_experts + 1,), jnp.int32).at[nxt].add(1)[:num_experts]
  picked = jnp.take_along_axis(probs, jnp.minimum(e, num_experts - 1), axis=1)
  nxt_p = jnp.take_along_axis(probs, jnp.minimum(nxt, num_experts - 1)[:, None], axis=1)[:, 0]
  ranks = ranks_within(jnp.concatenate([e.reshape(-1), nxt + num_experts + 1]),
                       jnp.concatenate([picked.reshape(-1), nxt_p]), 2 * num_experts + 2)
  return valid, e, counts, candidates, picked, nxt_p, ranks[:e.size].reshape(e.shape), ranks[e.size:]


def block_moves_reference(probs: Float[Array, "tokens experts"], expert: Int[Array, "tokens k"],
                          nxt: Int[Array, "tokens"], block: int) -> tuple[Bool[Array, "tokens k"], Bool[Array, "tokens"]]:
  """(keep, add) of op.block_moves: ranks within each expert by one sort, against move_counts' keep_n and add_n."""
  num_experts = probs.shape[1]
  valid, e, counts, candidates, _, _, rank, add_rank = _ranked(probs, expert, nxt)
  keep_n, add_n = move_counts(counts, candidates, block)
  keep = valid & (rank < _with_none(keep_n)[e])
  add = (nxt < num_experts) & (add_rank < _with_none(add_n)[nxt])
  return keep, add


def group_moves_reference(probs: Float[Array, "tokens experts"], expert: Int[Array, "tokens k"],
                          nxt: Int[Array, "tokens"], block: int, axis_name) -> tuple[Bool[Array, "tokens k"],
                                                                                     Bool[Array, "tokens"]]:
  """(keep, add) of op.block_moves with axis_name: this device's rows of the moves on the group's tokens,
  concatenated in axis order. The counts are psums; each device ranks its own items by one sort, and the group's
  n-th item of each expert is found among the items each device sends (_among_first)."""
  num_tokens = probs.shape[0]
  group_sum = lambda a: jax.lax.psum(a, axis_name)
  valid, e, local_counts, candidates, picked, nxt_p, rank, add_rank = _ranked(probs, expert, nxt)
  counts = group_sum(local_counts)
  keep_n, add_n = move_counts(counts, group_sum(candidates), block)
  # The group's order is the concatenation's: index = the item's position in it, for ties.
  me = jax.lax.axis_index(axis_name).astype(jnp.int32)
  index = me * e.size + jnp.arange(e.size, dtype=jnp.int32).reshape(e.shape)
  low = _with_none(local_counts)[e] - 1 - rank  # 0: the device's least likely assignment to e
  # counts - keep_n < b assignments are dropped, add_n <= b / 2 added: those many are all that can move.
  keep = valid & ~_among_first(counts - keep_n, low, e, picked, index, block, axis_name, ascending=True)
  token = me * num_tokens + jnp.arange(num_tokens, dtype=jnp.int32)
  add = _among_first(add_n, add_rank, nxt, nxt_p, token, max(block // 2, 1), axis_name, ascending=False)
  return keep, add


def _among_first(n: Int[Array, "keys"], local: Int[Array, "*items"], key: Int[Array, "*items"],
                 score: Float[Array, "*items"], index: Int[Array, "*items"], depth: int, axis_name, *,
                 ascending: bool) -> Bool[Array, "*items"]:
  """Whether an item is among the first n[key] of the group's items of its key, ordered by score (ascending:
  ties to the higher index first; descending: to the lower), for n <= depth. local: its position among its
  own device's items of that key. Keys >= len(n) are not items.

  Each device sends its first depth items of every key; the first n of the group are among them, so the
  n-th of the sent items, in that order, is the group's n-th: an item is among the first n iff it is not
  after that one. A sort of keys * devices * depth items, then a comparison per item.
  """
  num_keys = n.shape[0]
  row = jnp.where((key < num_keys) & (local < depth), key, num_keys)  # row num_keys: out of bounds, dropped
  col = jnp.clip(local, 0, depth - 1)
  order_score = score if ascending else -score
  order_index = -index if ascending else index
  scores = jnp.full((num_keys, depth), jnp.inf, jnp.float32).at[row, col].set(order_score, mode="drop")
  indices = jnp.zeros((num_keys, depth), jnp.int32).at[row, col].set(order_index, mode="drop")
  gather = lambda a: jnp.moveaxis(jax.lax.all_gather(a, axis_name), 0, 1).reshape(num_keys, -1)
  scores, indices = jax.lax.sort((gather(scores), gather(indices)), dimension=1, num_keys=2)
  nth = jnp.clip(n - 1, 0, scores.shape[1] - 1)[:, None]
  last_s = jnp.take_along_axis(scores, nth, axis=1)[:, 0]
  last_i = jnp.take_along_axis(indices, nth, axis=1)[:, 0]
  k = jnp.minimum(key, num_keys - 1)
  within = (order_score < last_s[k]) | ((order_score == last_s[k]) & (order_index <= last_i[k]))
  return (key < num_keys) & (n[k] > 0) & within
