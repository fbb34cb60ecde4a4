"""group_rows: the Pallas kernel (interpret mode off the GPU) against the XLA reference and a numpy loop of the
placement, its gradient, the dispatch and the errors; the decode MoE layer through it (inference.decode_moe)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.kernels import group_rows as gr
from tests.moe_testing import seed_of

G = 16
# The reference, one jitted program (op by op, every case's shapes compiled dozens of small ones).
_reference = jax.jit(gr.group_rows_reference, static_argnums=(2, 3))
# (tokens, k, experts, d, how ids are drawn)
CASES = {
    "medium_b32": (32, 1, 64, 512, "uniform"),  # two 256-column blocks
    "top2_of_8": (24, 2, 8, 64, "uniform"),
    "all_on_one_expert": (40, 1, 4, 128, "one"),  # three groups of expert 0
    "one_expert": (33, 1, 1, 32, "uniform"),
    "k_equals_E": (17, 3, 3, 64, "permutation"),  # every expert 17 pairs: two groups each, the bound exactly
    "no_expert_ids": (20, 3, 6, 64, "with_none"),  # 60 pairs (not a power of two), some outside [0, E)
}


def _case(name, dtype):
  t, k, e, d, how = CASES[name]
  rng = np.random.default_rng(seed_of(name, str(dtype)))
  x = jnp.asarray(rng.standard_normal((t, d)), dtype)
  if how == "one":
    ids = np.zeros((t, k), int)
  elif how == "permutation":
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)])
  else:
    ids = rng.integers(0, e, (t, k))
    if how == "with_none":
      ids[rng.random((t, k)) < 0.2] = -1
      ids[0, 0], ids[1, 1] = e, e + 3  # ids at or past E hold no expert either
  return x, jnp.asarray(ids.reshape(-1), jnp.int32), e


def _placement_loop(ids, tokens, num_experts):
  """numpy: expert by expert, its pairs in order, G rows a group; the groups after the last filled one empty."""
  k = len(ids) // tokens
  groups = gr.row_groups(len(ids), num_experts, G)
  experts, rows, slot = [num_experts] * groups, [[] for _ in range(groups)], [groups * G] * len(ids)
  g = 0
  for e in range(num_experts):
    pairs = [a for a in range(len(ids)) if ids[a] == e]
    for i in range(0, len(pairs), G):
      experts[g] = e
      for r, a in enumerate(pairs[i:i + G]):
        rows[g].append(a // k)
        slot[a] = g * G + r
      g += 1
  return experts, rows, slot


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_the_reference_and_the_loop(name, dtype):
  x, ids, e = _case(name, dtype)
  xs, experts, slot, counts = jax.jit(lambda x, i: gr.group_rows(x, i, e, impl="triton"))(x, ids)
  groups = gr.row_groups(ids.shape[0], e, G)
  assert xs.shape == (groups, G, x.shape[1]) and xs.dtype == x.dtype
  assert experts.dtype == slot.dtype == counts.dtype == jnp.int32 and slot.shape == ids.shape
  for got, want in zip((xs, experts, slot, counts), _reference(x, ids, e, G)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # integers and moved rows: bit-exact
  i = np.asarray(ids)
  np.testing.assert_array_equal(np.asarray(counts), np.bincount(i[(i >= 0) & (i < e)], minlength=e))
  want_experts, rows, want_slot = _placement_loop(np.asarray(ids), x.shape[0], e)
  np.testing.assert_array_equal(np.asarray(experts), want_experts)
  np.testing.assert_array_equal(np.asarray(slot), want_slot)
  xs = np.asarray(xs)  # indexed on the host
  for g, toks in enumerate(rows):
    np.testing.assert_array_equal(xs[g, :len(toks)], np.asarray(x)[toks])
    assert not np.any(xs[g, len(toks):])


def test_every_pair_without_an_expert():
  x = jnp.ones((18, 64), jnp.float32)
  xs, experts, slot, counts = gr.group_rows(x, jnp.full((18,), -1, jnp.int32), 8, impl="triton")
  assert not np.any(np.asarray(xs)) and not np.any(np.asarray(counts))
  np.testing.assert_array_equal(np.asarray(experts), 8)
  np.testing.assert_array_equal(np.asarray(slot), xs.shape[0] * G)


def test_gradient_is_the_reference_one():
  x, ids, e = _case("top2_of_8", jnp.float32)
  cot = jnp.asarray(np.random.default_rng(2).standard_normal((gr.row_groups(ids.shape[0], e, G), G, x.shape[1])),
                    jnp.float32)
  loss = lambda impl: lambda x: jnp.sum(gr.group_rows(x, ids, e, impl=impl)[0] * cot)
  got, want = jax.jit(jax.grad(loss("triton")))(x), jax.jit(jax.grad(loss("xla")))(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  # dx[t] sums the cotangent rows of token t's k pairs
  _, rows, _ = _placement_loop(np.asarray(ids), x.shape[0], e)
  oracle, cot = np.zeros(x.shape), np.asarray(cot)
  for g, toks in enumerate(rows):
    for r, t in enumerate(toks):
      oracle[t] += cot[g, r]
  np.testing.assert_allclose(np.asarray(got), oracle, rtol=1e-6, atol=1e-6)


def test_row_groups_bounds_every_routing():
  rng = np.random.default_rng(5)
  for _ in range(200):
    tk, e = int(rng.integers(1, 65)), int(rng.integers(1, 70))
    counts = np.bincount(rng.integers(0, e, tk) if rng.random() < 0.7 else np.zeros(tk, int), minlength=e)
    assert np.sum(-(-counts // G)) <= gr.row_groups(tk, e, G)
  assert (gr.row_groups(51, 3, G) == 6 and gr.row_groups(48, 3, G) == 5 and gr.row_groups(33, 1, G) == 3
          and gr.row_groups(64, 64, G) == 64)


def test_dispatch_and_errors():
  x, ids, e = _case("top2_of_8", jnp.float32)
  assert gr.runs_kernel(48, 8, 64) == (jax.default_backend() == "gpu")  # "auto": the kernel on a GPU only
  assert not gr.runs_kernel(48, 8, 48)  # a width no block divides
  assert gr.runs_kernel(48, 8, 64, "triton")
  assert not gr.runs_kernel(48, 8, 64, group=12)  # a group no power of two: never the kernel under "auto"
  with pytest.raises(ValueError, match="impl must be one of"):
    gr.group_rows(x, ids, e, impl="cuda")
  with pytest.raises(ValueError, match="x must have rank 2"):
    gr.group_rows(x[None], ids, e)
  with pytest.raises(ValueError, match=r"ids must have rank 1"):
    gr.group_rows(x, ids.reshape(24, 2), e)
  with pytest.raises(TypeError, match="ids must be an integer"):
    gr.group_rows(x, ids.astype(jnp.float32), e)
  with pytest.raises(ValueError, match=r"k pairs a token, \[tokens \* k\]; got 47 ids for 24 tokens"):
    gr.group_rows(x, ids[:47], e)
  with pytest.raises(ValueError, match="num_experts and group must be positive"):
    gr.group_rows(x, ids, 0)
  with pytest.raises(ValueError, match=r"impl='triton' needs d a multiple of 256 .* got d=48"):
    gr.group_rows(x[:, :48], ids, e, impl="triton")
  with pytest.raises(ValueError, match=r"a power-of-two group .* group=12"):
    gr.group_rows(x, ids, e, group=12, impl="triton")
  for got, want in zip(gr.group_rows(x, ids, e, group=12), gr.group_rows_reference(x, ids, e, 12)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # "auto" where the kernel does not take the shape: the reference, same answer
  for got, want in zip(gr.group_rows(x[:, :48], ids, e), gr.group_rows_reference(x[:, :48], ids, e, G)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
