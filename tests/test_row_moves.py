"""row_moves.gather_rows: the Pallas kernel (interpret mode off the GPU) against XLA's filling gather,
its gradient against the transpose of the gather, the dispatch and the errors; and the MoE layer's
gather through it (permute.gather_rows)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import permute
from sparsejax.kernels import row_moves
from sparsejax.kernels.row_moves import triton
from tests.moe_testing import seed_of

# (n, d, rows): rows not a multiple of the 64-row block and crossing several; d across several
# 128-column blocks (384), one smaller power of two (64), the layer's padded buffer of a few tokens.
CASES = {
    "several_blocks": (50, 384, 200),
    "narrow": (7, 64, 70),
    "one_block": (3, 128, 5),
    "buffer_of_one_token": (1, 256, 128),
}


def _case(name, dtype, fill_fraction=0.3):
  n, d, r = CASES[name]
  rng = np.random.default_rng(seed_of(name, str(dtype)))
  x = jnp.asarray(rng.standard_normal((n, d)), dtype)
  src = rng.integers(0, n, r)
  src[rng.random(r) < fill_fraction] = n  # "no row": a padding row of the buffer
  return x, jnp.asarray(src, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_the_reference(name, dtype):
  x, src = _case(name, dtype)
  got = jax.jit(lambda x, s: row_moves.gather_rows(x, s, impl="triton"))(x, src)
  assert got.dtype == x.dtype and got.shape == (src.shape[0], x.shape[1])
  want = np.where((np.asarray(src) < x.shape[0])[:, None], np.asarray(x)[np.minimum(src, x.shape[0] - 1)], 0)
  np.testing.assert_array_equal(np.asarray(got), want)  # a move: bit-exact
  np.testing.assert_array_equal(np.asarray(got), np.asarray(row_moves.gather_rows_reference(x, src)))


def test_all_rows_empty_and_every_row_of_one_token():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 128)), jnp.float32)
  empty = row_moves.gather_rows(x, jnp.full((100,), 4, jnp.int32), impl="triton")
  np.testing.assert_array_equal(np.asarray(empty), 0)
  one = row_moves.gather_rows(x, jnp.full((100,), 2, jnp.int32), impl="triton")
  np.testing.assert_array_equal(np.asarray(one), np.broadcast_to(np.asarray(x[2]), (100, 128)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gradient_is_the_transpose_of_the_gather(dtype):
  x, src = _case("several_blocks", dtype)
  g = jnp.asarray(np.random.default_rng(1).standard_normal((src.shape[0], x.shape[1])), dtype)
  got = jax.grad(lambda x: jnp.sum((row_moves.gather_rows(x, src, impl="triton") * g).astype(jnp.float32)))(x)
  assert got.dtype == dtype
  s = np.asarray(src)
  want = np.zeros(x.shape, np.float64)  # float64: dx[t] = sum of g[r] over the r with src[r] = t
  np.add.at(want, s[s < x.shape[0]], np.asarray(g, np.float64)[s < x.shape[0]])
  # Summed in float32, rounded once to the dtype.
  tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2**-8, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, **tol)
  counts = np.bincount(s, minlength=x.shape[0] + 1)[: x.shape[0]]
  assert (np.asarray(got)[counts == 0] == 0).all() and (counts > 1).any()  # unpicked rows, repeated rows


def test_layer_gather_runs_through_the_op_and_keeps_its_own_gradient():
  """permute.gather_rows forwards through row_moves.gather_rows; its VJP still gathers by rows."""
  rng = np.random.default_rng(2)
  ids = jnp.asarray(rng.integers(0, 4, (30, 2)), jnp.int32)
  x = jnp.asarray(rng.standard_normal((30, 128)), jnp.float32)
  placement = permute.dropless_placement(ids, 4, block_size=16)
  src = permute.source_tokens(placement, 30)
  buf = permute.gather_rows(x, placement)
  np.testing.assert_array_equal(np.asarray(buf), np.asarray(row_moves.gather_rows_reference(x, src)))
  jaxpr = str(jax.make_jaxpr(lambda x: permute.gather_rows(x, placement))(x))
  assert "pallas_call" in jaxpr if row_moves.runs_kernel(128) else "pallas_call" not in jaxpr
  g = jnp.asarray(rng.standard_normal(buf.shape), jnp.float32)
  dx = jax.grad(lambda x: jnp.sum(permute.gather_rows(x, placement) * g))(x)
  want = np.zeros_like(np.asarray(x))
  np.add.at(want, np.asarray(src)[np.asarray(src) < 30], np.asarray(g)[np.asarray(src) < 30])
  np.testing.assert_allclose(np.asarray(dx), want, rtol=1e-6, atol=1e-6)


def test_dispatch():
  assert row_moves.runs_kernel(1024, "triton") and not row_moves.runs_kernel(1024, "xla")
  assert row_moves.runs_kernel(1024) == (jax.default_backend() == "gpu")
  assert not row_moves.runs_kernel(96)  # neither a multiple of 128 nor a power of two
  assert triton.block_d_for(64) == 64 and triton.block_d_for(384) == 128 and triton.block_d_for(96) is None
  x = jnp.ones((3, 96), jnp.float32)
  np.testing.assert_array_equal(np.asarray(row_moves.gather_rows(x, jnp.array([0, 3]))), [[1] * 96, [0] * 96])
  assert row_moves.gather_rows(x, jnp.zeros((0,), jnp.int32), impl="auto").shape == (0, 96)


@pytest.mark.parametrize("args, impl, err, match", [
    ((jnp.ones((3, 128)), jnp.zeros((2,), jnp.int32)), "cuda", ValueError, "impl must be one of"),
    ((jnp.ones((3, 128)), jnp.zeros((2, 1), jnp.int32)), "auto", ValueError, r"src must have rank 1 \(\[rows\]\)"),
    ((jnp.ones((3,)), jnp.zeros((2,), jnp.int32)), "auto", ValueError, r"x must have rank 2 \(\[n, d\]\)"),
    ((jnp.ones((3, 128)), jnp.zeros((2,), jnp.float32)), "auto", TypeError, "src must be an integer array"),
    ((jnp.ones((3, 96)), jnp.zeros((2,), jnp.int32)), "triton", ValueError, "d=96"),
])
def test_errors(args, impl, err, match):
  with pytest.raises(err, match=match):
    row_moves.gather_rows(*args, impl=impl)


def test_kernel_masks_its_last_block_to_the_rows():
  """Pallas Triton masks no block access: at rows not a multiple of the 64-row block the last program's src reads
  and stores must carry masks, or its stores land past the output (on an H100 they zeroed a capacity layer's router
  weights). Interpret mode drops such writes, so the Triton IR is checked: every load and store is masked."""
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
  import triton_sass
  (ttir,) = triton_sass.ttir_of(lambda x, s: triton.gather_rows(x, s, interpret=False),
                                jax.ShapeDtypeStruct((7, 64), jnp.float32), jax.ShapeDtypeStruct((70,), jnp.int32))
  lines = [ln.strip() for ln in ttir.splitlines()]
  stores = [ln for ln in lines if ln.startswith("tt.store")]
  loads = [ln for ln in lines if "= tt.load" in ln]
  assert stores and loads
  # masked: tt.store ptr, value, mask and tt.load ptr, mask(, other)
  assert all(ln.split(":")[0].count(",") >= 2 for ln in stores), stores
  assert all(ln.split(":")[0].count(",") >= 1 for ln in loads), loads
