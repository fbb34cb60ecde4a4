"""Placement of (token, slot) assignments in the expert buffer: dropless (block-padded) and capacity.

The block-padded layout (block 128) is what the Pallas backend runs on; here it is checked on the
CPU with the other backends, so the layout is right before the kernels arrive.
"""
from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax as sj
from sparsejax import parallel, permute
from sparsejax.topology import make_topology
from moe_testing import IMPLS, assert_close, rand, seed_of


def _ids(T, E, k, seed, none_frac=0.0):
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
  ids[rng.random((T, k)) < none_frac] = sj.NO_EXPERT
  return ids


# The placements, jitted: one program each, not op by op.
_dropless = jax.jit(permute.dropless_placement, static_argnums=(1,), static_argnames="block_size")
_capacity = jax.jit(permute.capacity_placement, static_argnums=(1, 2))


def _value_and_vjp(fn, *args, ct):
  """fn(*args) and its vjp of the cotangent ct, as one jitted program."""
  def run(ct, *args):
    y, vjp = jax.vjp(fn, *args)
    return y, vjp(ct)
  return jax.jit(run)(ct, *args)


def _check_placement(p, ids, E, block, capacity=None):
  rows = np.asarray(p.rows)
  valid = ids >= 0
  counts = np.bincount(ids[valid], minlength=E)
  np.testing.assert_array_equal(p.tokens_per_expert, counts)
  gs = np.asarray(p.group_sizes)
  if capacity is None:
    np.testing.assert_array_equal(gs, -(-counts // block) * block)  # padded up to the block
    assert gs.sum() <= p.num_rows
  else:
    np.testing.assert_array_equal(gs, [capacity] * E)
    assert p.num_rows == E * capacity
  starts = np.cumsum(gs) - gs
  seen = np.zeros(E, int)
  dropped = 0
  for t in range(ids.shape[0]):  # token order fills each expert's rows from its start
    for j in range(ids.shape[1]):
      e = ids[t, j]
      if e < 0:
        assert rows[t, j] == p.num_rows
        continue
      if capacity is not None and seen[e] >= capacity:
        assert rows[t, j] == p.num_rows
        dropped += 1
      else:
        assert rows[t, j] == starts[e] + seen[e], (t, j)
      seen[e] += 1
  assert int(p.num_dropped) == dropped
  kept = rows[rows < p.num_rows]
  assert len(set(kept.tolist())) == kept.size, "two assignments share a row"


@pytest.mark.parametrize("block", [1, 4, 128])
@pytest.mark.parametrize("T,E,k,none_frac", [(37, 4, 2, 0.0), (130, 8, 3, 0.2), (1, 4, 1, 0.0), (9, 1, 1, 0.0)])
def test_dropless_placement(T, E, k, none_frac, block):
  ids = _ids(T, E, k, seed_of("place", T, E, k, block), none_frac)
  p = _dropless(jnp.asarray(ids), E, block_size=block)
  _check_placement(p, ids, E, block)


@pytest.mark.parametrize("T,E,k,C", [(37, 4, 2, 5), (20, 3, 1, 20), (12, 4, 4, 1)])
def test_capacity_placement(T, E, k, C):
  ids = _ids(T, E, k, seed_of("cap_place", T, E, k, C), 0.1)
  p = _capacity(jnp.asarray(ids), E, C)
  _check_placement(p, ids, E, 1, capacity=C)


def test_dropless_num_rows_bound_is_tight_enough():
  """Worst case for padding: every expert's count is one more than a multiple of the block."""
  E, b = 4, 8
  ids = np.repeat(np.arange(E), b + 1)[:, None].astype(np.int32)  # counts 9, 9, 9, 9
  p = permute.dropless_placement(jnp.asarray(ids), E, block_size=b)
  assert int(np.sum(p.group_sizes)) == E * 2 * b <= p.num_rows


@jax.jit
def _padded_reference(x, cw, w_in, w_out, w_gate, ids):
  """The reference layer's gradients of sum(sin(y)), and y: the cases below share its compile."""
  ref = lambda *a: sj.moe_mlp_reference(a[0], ids, *a[1:4], w_gate=a[4], activation=jax.nn.silu)
  return jax.grad(lambda *a: (lambda y: (jnp.sum(jnp.sin(y)), y))(ref(*a)), argnums=tuple(range(5)),
                  has_aux=True)(x, cw, w_in, w_out, w_gate)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block", [4, 128])
def test_block_padded_layout_computes_the_moe(impl, block):
  """gather -> expert_ffn on padded group sizes -> scatter equals the reference (the Pallas data path)."""
  T, E, k, d, f = 45, 4, 2, 8, 8
  rng = np.random.default_rng(seed_of("padded", impl, block))
  x = jnp.asarray(rand(rng, (T, d)))
  w_in, w_out, w_gate = (jnp.asarray(rand(rng, s, 0.4)) for s in ((E, d, f), (E, f, d), (E, d, f)))
  ids = jnp.asarray(_ids(T, E, k, 3, 0.1))
  cw = jnp.asarray(rng.uniform(0.1, 1, (T, k)).astype(np.float32))

  def padded_moe(x, cw, w_in, w_out, w_gate):
    p = permute.dropless_placement(ids, E, block_size=block)
    buf = permute.gather_rows(x, p)
    out = sj.expert_ffn(buf, p.group_sizes, w_in, w_out, w_gate=w_gate, activation=jax.nn.silu, impl=impl)
    return permute.scatter_rows(out, p, cw, x.dtype)

  args = (x, cw, w_in, w_out, w_gate)
  # The values ride along as aux: one program gives them and the gradients.
  value_and_grads = lambda fn: jax.grad(lambda *a: (lambda y: (jnp.sum(jnp.sin(y)), y))(fn(*a)),
                                        argnums=tuple(range(5)), has_aux=True)
  g, y = jax.jit(value_and_grads(padded_moe))(*args)
  g_ref, y_ref = _padded_reference(*args, ids)
  assert_close(y, y_ref, 1e-5, "padded forward")
  for a, b, n in zip(g, g_ref, ("x", "cw", "w_in", "w_out", "w_gate")):
    assert_close(a, b, 1e-5, n)


def _plain_moves(x, p, cw):
  """gather_rows and scatter_rows as plain indexing, differentiated by autodiff (scatter-add transposes)."""
  src = jnp.full((p.num_rows,), x.shape[0], jnp.int32).at[p.rows.reshape(-1)].set(
      jnp.repeat(jnp.arange(x.shape[0], dtype=jnp.int32), p.rows.shape[1]), mode="drop")
  buf = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[src]
  out = buf * 1.5 + 0.25  # a stand-in for the experts, so the buffer's gradient is not the combine's alone
  picked = jnp.concatenate([out, jnp.zeros((1, out.shape[1]), out.dtype)])[p.rows].astype(jnp.float32)
  return jnp.sum(cw.astype(jnp.float32)[:, :, None] * picked, axis=1).astype(x.dtype)


@pytest.mark.parametrize("mode,dtype,tol", [("dropless", jnp.float32, 1e-6), ("dropless", jnp.bfloat16, 1e-2),
                                            ("capacity", jnp.float32, 1e-6), ("capacity", jnp.bfloat16, 1e-2),
                                            ("all_on_one", jnp.float32, 1e-6), ("k_equals_E", jnp.float32, 1e-6)])
def test_gather_and_scatter_gradients_are_the_autodiff_ones(mode, dtype, tol):
  """The custom VJPs (gathers both ways) give autodiff's values and gradients: dropped, unassigned and
  padding rows included, k = 1 and k > 1."""
  T, E, d = 37, 5, 6
  k = {"dropless": 2, "capacity": 2, "all_on_one": 1, "k_equals_E": E}[mode]
  rng = np.random.default_rng(seed_of("moves", mode, str(dtype)))
  ids = (np.zeros((T, 1), np.int32) if mode == "all_on_one"
         else _ids(T, E, k, seed_of("moves-ids", mode), 0.1 if mode != "k_equals_E" else 0.0))
  ids = jnp.asarray(ids)
  p = _capacity(ids, E, 6) if mode == "capacity" else _dropless(ids, E, block_size=4)
  x = jnp.asarray(rand(rng, (T, d))).astype(dtype)
  cw = jnp.asarray(rng.uniform(0.1, 1, (T, k)).astype(np.float32))

  def ours(x, cw):
    return permute.scatter_rows(permute.gather_rows(x, p) * 1.5 + 0.25, p, cw, x.dtype)

  loss = lambda fn: lambda x, cw: jnp.sum(jnp.sin(fn(x, cw).astype(jnp.float32)))
  assert_close(jax.jit(ours)(x, cw), jax.jit(_plain_moves)(x, p, cw), tol, "forward")
  g = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(x, cw)
  g_ref = jax.jit(jax.grad(loss(lambda x, cw: _plain_moves(x, p, cw)), argnums=(0, 1)))(x, cw)
  for a, b, n in zip(g, g_ref, ("x", "cw")):
    assert a.dtype == b.dtype, n
    assert_close(a, b, tol, n)


def _skewed_ids(T, E, k, seed, none_frac=0.1):
  """Distinct experts per token drawn with skewed odds, so capacity placement both drops (popular
  experts) and leaves rows empty (rare ones)."""
  rng = np.random.default_rng(seed)
  odds = np.geomspace(0.05, 1.0, E)  # the last expert most popular: in capacity mode the last row is filled
  ids = np.stack([rng.choice(E, k, replace=False, p=odds / odds.sum()) for _ in range(T)]).astype(np.int32)
  ids[rng.random((T, k)) < none_frac] = sj.NO_EXPERT
  ids[-1, -1] = sj.NO_EXPERT  # at least one unassigned pair
  return ids


@pytest.mark.parametrize("mode", ["capacity", "dropless"])
@pytest.mark.parametrize("k", [1, 2])
def test_scatter_rows_vjp_is_the_autodiff_one(mode, k):
  """scatter_rows' own backward (dc reduced in buffer-row order, then gathered by rows) against
  autodiff of y[t] = sum_j w[t, j] buffer[rows[t, j]], the buffer an input of its own, float32:
  dropped and unassigned pairs get dw = 0, empty rows get dbuffer = 0."""
  T, E, d = 41, 6, 24
  ids = jnp.asarray(_skewed_ids(T, E, k, seed_of("scatter-vjp", mode, k)))
  p = _capacity(ids, E, 4 * k) if mode == "capacity" else _dropless(ids, E, block_size=8)
  rows = np.asarray(p.rows)
  filled = np.zeros(p.num_rows, bool)
  filled[rows[rows < p.num_rows]] = True
  assert (rows == p.num_rows).any(), "no pair goes nowhere"
  assert not filled.all(), "no empty buffer row"
  if mode == "capacity":  # drops, and the last row is filled, so a clamped "no row" index would read it
    assert int(p.num_dropped) > 0 and filled[-1]
  rng = np.random.default_rng(seed_of("scatter-vjp-data", mode, k))
  buf = jnp.asarray(rand(rng, (p.num_rows, d)))
  w = jnp.asarray(rng.uniform(0.1, 1, (T, k)).astype(np.float32))
  dy = jnp.asarray(rand(rng, (T, d)))

  def plain(buf, w):
    picked = jnp.concatenate([buf, jnp.zeros((1, d), buf.dtype)])[p.rows]  # [T, k, d], row num_rows reads 0
    return jnp.sum(w[:, :, None] * picked, axis=1)

  y, (dbuf, dw) = _value_and_vjp(lambda b, w: permute.scatter_rows(b, p, w, jnp.float32), buf, w, ct=dy)
  y_ref, (dbuf_ref, dw_ref) = _value_and_vjp(plain, buf, w, ct=dy)
  assert_close(y, y_ref, 1e-6, "forward")
  assert dbuf.dtype == buf.dtype and dw.dtype == w.dtype
  np.testing.assert_array_equal(dbuf, dbuf_ref)  # one product per row either way
  np.testing.assert_array_equal(np.asarray(dbuf)[~filled], 0)
  assert_close(dw, dw_ref, 1e-6, "dw")  # the same d-term sum, in row order instead of token order
  np.testing.assert_array_equal(np.asarray(dw)[rows == p.num_rows], 0)
  expected = np.einsum("td,tkd->tk", np.asarray(dy, np.float64),
                       np.concatenate([np.asarray(buf, np.float64), np.zeros((1, d))])[rows])
  assert_close(dw, expected, 1e-6, "dw vs float64")


def _equations(jaxpr):
  """The equations of a jaxpr and of every jaxpr nested in them."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _equations(sub)


def _primitives(jaxpr) -> set[str]:
  """The primitives of a closed jaxpr and of every jaxpr nested in its equations."""
  return {eqn.primitive.name for eqn in _equations(jaxpr)}


def test_dropless_index_path_has_no_loop():
  """The placement and the topology of the dropless layer are loop-free: a while loop (jnp.searchsorted's
  default binary search did it) runs on a GPU as a few small launches an iteration outside XLA's
  command buffers, 42 us of E64 top-1's 2.4 ms layer on an H100."""
  def index_path(ids):
    plc = permute.dropless_placement(ids, 64, block_size=128)
    return make_topology(plc.group_sizes, plc.num_rows, 128, plc.tokens_per_expert)

  loops = {"while", "scan"}  # a fori_loop of static length is a scan, an XLA while loop on a GPU
  ids = jnp.zeros((512, 2), jnp.int32)
  assert not loops & _primitives(jax.make_jaxpr(index_path)(ids).jaxpr)
  assert not loops & _primitives(jax.make_jaxpr(
      lambda c: parallel.received_expert_ids(c, 256))(jnp.ones((4, 8), jnp.int32)).jaxpr)


def test_scatter_rows_backward_gathers_a_bf16_cotangent_in_bf16():
  """With a bf16 output the backward gathers dy (tokens x d) to the buffer rows as bf16, half the
  bytes of a float32 copy, and its gradients equal autodiff of the float32 combine cast to bf16."""
  T, E, d, k = 41, 6, 24, 2
  ids = jnp.asarray(_skewed_ids(T, E, k, seed_of("scatter-bf16", k)))
  p = _dropless(ids, E, block_size=8)
  assert p.num_rows != T
  rng = np.random.default_rng(seed_of("scatter-bf16-data", k))
  buf = jnp.asarray(rand(rng, (p.num_rows, d))).astype(jnp.bfloat16)
  w = jnp.asarray(rng.uniform(0.1, 1, (T, k)).astype(np.float32))
  dy = jnp.asarray(rand(rng, (T, d))).astype(jnp.bfloat16)
  f = lambda b, w: permute.scatter_rows(b, p, w, jnp.bfloat16)

  def plain(buf, w):
    picked = jnp.concatenate([buf, jnp.zeros((1, d), buf.dtype)])[p.rows].astype(jnp.float32)
    return jnp.sum(w[:, :, None] * picked, axis=1).astype(jnp.bfloat16)

  y, (dbuf, dw) = _value_and_vjp(f, buf, w, ct=dy)
  y_ref, (dbuf_ref, dw_ref) = _value_and_vjp(plain, buf, w, ct=dy)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  np.testing.assert_array_equal(np.asarray(dbuf, np.float32), np.asarray(dbuf_ref, np.float32))
  assert_close(dw, dw_ref, 1e-6, "dw")
  backward = jax.make_jaxpr(lambda dy: jax.vjp(f, buf, w)[1](dy))(dy)
  gathered = [e.invars[0].aval for e in _equations(backward.jaxpr)
              if e.primitive.name == "gather" and e.invars[0].aval.shape == (T, d)]
  assert gathered and all(a.dtype == jnp.bfloat16 for a in gathered), gathered


@pytest.mark.parametrize("mode,dtype", [("dropless", jnp.float32), ("dropless", jnp.bfloat16),
                                        ("all_on_one", jnp.float32), ("capacity", jnp.float32)])
def test_ungather_rows_is_the_indexing_with_a_gather_for_backward(mode, dtype):
  """out[t] = buffer[rows[t, 0]] (zero for unplaced t) as plain indexing gives it, forward and backward:
  every empty or padding row's gradient is zero, and the backward is a gather, not autodiff's
  scatter-add into a zeroed buffer (a [P*S, d] fill and atomics an MoE layer under expert parallelism)."""
  T, E, d = 53, 5, 24
  ids = (jnp.zeros((T, 1), jnp.int32) if mode == "all_on_one"
         else jnp.asarray(_skewed_ids(T, E, 1, seed_of("ungather", mode))))
  p = _capacity(ids, E, 6) if mode == "capacity" else _dropless(ids, E, block_size=8)
  rows = np.asarray(p.rows)
  filled = np.zeros(p.num_rows, bool)
  filled[rows[rows < p.num_rows]] = True
  assert not filled.all()
  rng = np.random.default_rng(seed_of("ungather-data", mode, str(dtype)))
  buf = jnp.asarray(rand(rng, (p.num_rows, d))).astype(dtype)
  dy = jnp.asarray(rand(rng, (T, d))).astype(dtype)
  plain = lambda b: jnp.concatenate([b, jnp.zeros((1, d), b.dtype)])[p.rows[:, 0]]
  y, (dbuf,) = _value_and_vjp(lambda b: permute.ungather_rows(b, p), buf, ct=dy)
  y_ref, (dbuf_ref,) = _value_and_vjp(plain, buf, ct=dy)
  assert y.dtype == dbuf.dtype == dtype
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))  # moves, no arithmetic
  np.testing.assert_array_equal(np.asarray(dbuf, np.float32), np.asarray(dbuf_ref, np.float32))
  np.testing.assert_array_equal(np.asarray(dbuf, np.float32)[~filled], 0)
  if mode != "all_on_one":
    assert (rows == p.num_rows).any(), "no unplaced token"
    np.testing.assert_array_equal(np.asarray(y, np.float32)[rows[:, 0] == p.num_rows], 0)
  backward = jax.make_jaxpr(lambda b, g: jax.vjp(lambda b: permute.ungather_rows(b, p), b)[1](g))(buf, dy)
  assert not {"scatter-add", "scatter_add"} & _primitives(backward.jaxpr)
  assert {"scatter-add", "scatter_add"} & _primitives(
      jax.make_jaxpr(lambda b, g: jax.vjp(plain, b)[1](g))(buf, dy).jaxpr), "the check cannot see a scatter-add"


def test_ungather_rows_takes_one_assignment_a_token():
  p = _dropless(jnp.zeros((8, 2), jnp.int32), 2, block_size=4)
  with pytest.raises(ValueError, match="k = 1 assignments, got k = 2"):
    permute.ungather_rows(jnp.zeros((p.num_rows, 4)), p)
