"""The sort-free placement (histogram + cumulative sum) gives exactly the sort-based Placement."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import permute
from moe_testing import seed_of


def _random_ids(T, E, k, seed, none_frac=0.0):
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
  ids[rng.random((T, k)) < none_frac] = -1
  return ids


def _skewed_ids(T, E, k, seed):
  """Most assignments on expert 0, several experts empty, ids repeated within a token."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, max(1, E // 4), (T, k)).astype(np.int32)
  ids[rng.random((T, k)) < 0.5] = 0
  return ids


CASES = {  # name: ids
    "random": _random_ids(37, 8, 2, seed_of("hist", 1)),
    "with -1": _random_ids(130, 8, 3, seed_of("hist", 2), none_frac=0.3),
    "empty experts, repeats in a token": _skewed_ids(70, 16, 2, seed_of("hist", 3)),
    "all on one expert": np.full((50, 1), 3, np.int32),
    "k = E": _random_ids(21, 4, 4, seed_of("hist", 4)),
    "one expert": np.zeros((9, 1), np.int32),
    "one token": np.array([[2, 0]], np.int32),
    "all -1": np.full((6, 2), -1, np.int32),
    "out of range ids": np.array([[0, 5], [7, 1], [-3, 1], [2, 2]], np.int32),
}
NUM_EXPERTS = {"random": 8, "with -1": 8, "empty experts, repeats in a token": 16, "all on one expert": 4,
               "k = E": 4, "one expert": 1, "one token": 4, "all -1": 4, "out of range ids": 4}


# (block_size, chunk): chunk 5 leaves a partial last chunk, 1 is every assignment its own chunk, 128
# one chunk for most cases.
SETTINGS = ((1, 5), (8, 1), (128, 128))


@functools.partial(jax.jit, static_argnames="num_experts")
def _all_settings(ids, *, num_experts):
  """Both placements for every setting, in one program (one compile per case keeps the test fast)."""
  return [(permute.dropless_placement(ids, num_experts, block_size=b),
           permute.dropless_placement_histogram(ids, num_experts, block_size=b, chunk=c))
          for b, c in SETTINGS]


@pytest.mark.parametrize("case", list(CASES))
def test_same_placement_as_sort(case):
  ids = jnp.asarray(CASES[case])
  for (block_size, chunk), (old, new) in zip(SETTINGS, _all_settings(ids, num_experts=NUM_EXPERTS[case])):
    assert new.num_rows == old.num_rows
    for field in ("rows", "group_sizes", "tokens_per_expert", "num_dropped"):
      a, b = np.asarray(getattr(old, field)), np.asarray(getattr(new, field))
      assert a.dtype == b.dtype and a.shape == b.shape, field
      np.testing.assert_array_equal(b, a, err_msg=f"{case}, block {block_size}, chunk {chunk}: {field}")


@pytest.mark.parametrize("T,k,E,chunk", [(1000, 1, 64, 128), (333, 8, 64, 96)])
def test_rank_matches_sort_on_valid_ids(T, k, E, chunk):
  """Larger routings, several chunks with a partial last one: ranks agree wherever an id is valid."""
  ids = _random_ids(T, E, k, seed_of("hist_rank", T, k, E), none_frac=0.1)
  both = jax.jit(lambda i: (permute.rank_within_expert(i, E),
                            permute.rank_within_expert_histogram(i, E, chunk=chunk)))
  (rank_old, counts_old), (rank_new, counts_new) = both(jnp.asarray(ids))
  valid = ids >= 0
  np.testing.assert_array_equal(np.asarray(rank_new)[valid], np.asarray(rank_old)[valid])
  np.testing.assert_array_equal(counts_new, counts_old)
  np.testing.assert_array_equal(counts_new, np.bincount(ids[valid], minlength=E))


def test_histogram_chunk_keeps_the_in_chunk_comparison_under_its_bound():
  """32 where n * 32 fits IN_CHUNK_ELEMENTS; halved while it does not, but never below 8."""
  bound = permute.IN_CHUNK_ELEMENTS
  assert permute.histogram_chunk(1) == 32
  assert permute.histogram_chunk(bound // 32) == 32
  assert permute.histogram_chunk(bound // 32 + 1) == 16
  assert permute.histogram_chunk(bound // 8) == 8
  assert permute.histogram_chunk(100 * bound) == 8
  for n in (1, 1000, 2**19, 2**19 + 1, 2**20, 2**21):
    c = permute.histogram_chunk(n)
    assert c in (8, 16, 32) and n * c <= bound, (n, c)


def test_default_chunk_matches_sort_where_it_is_halved():
  """The default chunk (16 here, a partial last chunk) gives the sort's ranks and counts."""
  T, k, E = 65537, 9, 64  # n = 589,833 > 2^19: chunk 16
  assert permute.histogram_chunk(T * k) == 16
  ids = _random_ids(T, E, k, seed_of("hist_default", T))
  both = jax.jit(lambda i: (permute.rank_within_expert(i, E), permute.rank_within_expert_histogram(i, E)))
  (rank_old, counts_old), (rank_new, counts_new) = both(jnp.asarray(ids))
  np.testing.assert_array_equal(rank_new, rank_old)
  np.testing.assert_array_equal(counts_new, counts_old)


@pytest.mark.parametrize("case", ["with -1", "empty experts, repeats in a token", "out of range ids"])
def test_placements_pick_the_histogram_on_gpus_with_the_same_result(case, monkeypatch):
  """On a GPU backend dropless_placement and capacity_placement rank by histogram; the Placements
  (rows, sizes, counts, drops) are those of the argsort they use elsewhere."""
  ids, E = jnp.asarray(CASES[case]), NUM_EXPERTS[case]
  # Jitted (a trace each, made under its backend): one program each, not op by op.
  make = lambda: jax.jit(lambda ids: (permute.dropless_placement(ids, E, block_size=4),
                                      permute.capacity_placement(ids, E, 3)))(ids)
  cpu = make()
  used = []
  hist = permute.rank_within_expert_histogram
  monkeypatch.setattr(permute.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(permute, "rank_within_expert_histogram", lambda *a, **kw: used.append(1) or hist(*a, **kw))
  gpu = make()
  assert len(used) == 2
  for a, b in zip(cpu, gpu):
    for field in ("rows", "group_sizes", "tokens_per_expert", "num_dropped"):
      np.testing.assert_array_equal(getattr(b, field), getattr(a, field), err_msg=f"{case}: {field}")
