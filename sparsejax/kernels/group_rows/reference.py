"""group_rows' reference: the placement in XLA ops (counts, ranks, a scatter of rows)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def row_groups(num_pairs: int, num_experts: int, group: int) -> int:
  """Static bound on the groups of `group` rows that num_pairs (token, expert) pairs fill, each group one expert's:
  sum_e ceil(c_e / group) <= a + floor((num_pairs - a) / group), a = min(num_pairs, E)."""
  a = min(num_pairs, num_experts)
  return a + (num_pairs - a) // group


def group_rows_reference(
    x: Float[Array, "tokens d"], ids: Int[Array, "pairs"], num_experts: int, group: int
) -> tuple[Float[Array, "groups group d"], Int[Array, "groups"], Int[Array, "pairs"], Int[Array, "experts"]]:
  """(xs, experts, slot, counts) of op.group_rows, in XLA ops: one-hot counts and ranks, then a scatter of x's
  rows."""
  num_pairs, d = ids.shape[0], x.shape[1]
  groups = row_groups(num_pairs, num_experts, group)
  key = ids.astype(jnp.int32)
  valid = (key >= 0) & (key < num_experts)
  onehot = jax.nn.one_hot(jnp.where(valid, key, num_experts), num_experts, dtype=jnp.int32)  # [P, E]
  rank = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
  counts = jnp.sum(onehot, axis=0)
  per_expert = -(-counts // group)
  start = jnp.cumsum(per_expert) - per_expert
  g = jnp.where(valid, jnp.take(start, jnp.clip(key, 0, num_experts - 1)) + rank // group, groups)
  row = rank % group
  experts = jnp.full((groups,), num_experts, jnp.int32).at[g].set(key, mode="drop")
  token = jnp.arange(num_pairs) // (num_pairs // x.shape[0])
  xs = jnp.zeros((groups, group, d), x.dtype).at[g, row].set(x[token], mode="drop")
  slot = jnp.where(valid, g * group + row, groups * group).astype(jnp.int32)
  return xs, experts, slot, counts
