"""skinny_matmul: the Pallas Triton kernel (interpret mode off the GPU) against a float64 numpy oracle."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import kernels
from sparsejax.inference import quantize_weight
from sparsejax.kernels.pallas_triton_gpu import lower_for_gpu
from sparsejax.kernels.skinny_matmul import MAX_ROWS, skinny_matmul, skinny_matmul_reference
from sparsejax.kernels.skinny_matmul import triton as skinny_triton
from sparsejax.kernels.skinny_matmul.triton import default_config
from tests.moe_testing import seed_of

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _rounded(a, dtype) -> np.ndarray:
  """a in dtype, rounded as jnp.asarray(a, dtype) rounds it (float64 through float32), but on the host: a cast on
  the device compiled a small program for every shape (jax.device_put, not jnp.asarray, moves it: jnp.asarray's
  copy compiles one too)."""
  return np.asarray(a, np.float32).astype(dtype)


def _oracle(x, w, experts, scale=None):
  """float64: y[s] = x_s @ (W[e_s] * scale[e_s]), with the weight rounded to x's dtype first; y[s] = 0 for an
  id outside [0, E). W = w, or w^T for int8 w (stored k-major, as quantize_weight stores it)."""
  x64 = np.asarray(x, np.float64)
  ids = np.asarray(experts)
  present = (ids >= 0) & (ids < w.shape[0])
  ids = np.where(present, ids, 0)
  ws = np.asarray(_rounded(w, x.dtype), np.float64)[ids]
  if jnp.asarray(w).dtype == jnp.int8:
    ws = np.swapaxes(ws, -1, -2)
  xs = x64 if x64.ndim == 3 else np.broadcast_to(x64, (len(ids),) + x64.shape)
  y = np.einsum("smk,skn->smn", xs, ws)
  if scale is not None:
    y = y * np.asarray(scale, np.float64)[ids][:, None, :]
  return np.where(present[:, None, None], y, 0.0)


def _draw(seed, shape, dtype):
  return jax.device_put(_rounded(np.random.default_rng(seed).standard_normal(shape)
                                / np.sqrt(shape[-2] if len(shape) > 1 else 1), dtype))


# (m, k, n, experts, slot ids): k, n >= 300 cross several column blocks and K slabs; m = 1 takes the
# multiply-reduce path, m > 1 the dot path (rows padded to 16 / 64); ids repeat an expert and skip some.
CASES = {
    "one_row": (1, 384, 320, 5, [3, 0, 3]),
    "few_rows": (5, 384, 320, 4, [1, 2]),
    "rows_past_one_tile": (33, 320, 448, 3, [2, 2, 0]),
    "long_k_slabs_of_512": (2, 2048, 64, 2, [1]),
    "one_expert": (1, 320, 320, 1, [0]),
    "all_slots_one_expert": (3, 384, 320, 6, [4, 4, 4, 4]),
    # 16 slots x 8 column blocks: the wide tiles (128 columns by all 1,024 K rows), slots with no expert among them
    "wide_tiles_through_many_slots": (3, 1024, 1024, 4, [3, 0, 4, 1, 3, 2, -1, 0, 1, 1, 2, 3, 4, 4, 0, 2]),
}


def test_default_tiles():
  """One row keeps its tiles; more rows through several experts take the widest tile that leaves 128
  programs (the m = 32 sweeps); through one weight they keep the 64-column tiles."""
  tiles = lambda *a: (lambda c: (c.block_n, c.rows_per_program, c.use_dot))(default_config(*a))
  assert tiles(1, 1024, 4096, 2) == (64, 128, False) and tiles(1, 4096, 1024, 2) == (64, 512, True)
  assert tiles(32, 1024, 4096, 32) == (128, 1024, True)  # W_in through medium-moe's 32 slots: 1,024 programs
  assert tiles(32, 4096, 1024, 32) == (128, 2048, True)  # W_out: 512
  assert tiles(2, 1024, 4096, 2) == (64, 512, True)  # 128 by 1,024 would leave 64
  assert tiles(32, 1024, 3072, 1) == (64, 256, True) and tiles(32, 4096, 1024, 1) == (64, 512, True)
  assert tiles(5, 384, 320, 4) == (64, 128, True)  # K not a multiple of 512


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_oracle(name, dtype):
  m, k, n, e, ids = CASES[name]
  seed = seed_of(name, str(dtype))
  x, w = _draw(seed, (m, k), dtype), _draw(seed + 1, (e, k, n), dtype)
  experts = jnp.asarray(ids, jnp.int32)
  got = jax.jit(lambda x, w: skinny_matmul(x, w, experts=experts, impl="triton"))(x, w)
  assert got.dtype == jnp.float32 and got.shape == (len(ids), m, n)
  np.testing.assert_allclose(np.asarray(got), _oracle(x, w, experts), **TOL[dtype])
  # one x per slot (the down projection of decode_moe_mlp)
  xs = _draw(seed + 2, (len(ids), m, k), dtype)
  got = jax.jit(lambda xs, w: skinny_matmul(xs, w, experts=experts, impl="triton"))(xs, w)
  np.testing.assert_allclose(np.asarray(got), _oracle(xs, w, experts), **TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m", [1, 4])
def test_int8_weights_with_scales(m, dtype):
  seed = seed_of("int8", m, str(dtype))
  x = _draw(seed, (m, 320), dtype)
  q, s = quantize_weight(_draw(seed + 1, (3, 320, 384), jnp.float32))
  experts = jnp.asarray([2, 0], jnp.int32)
  got = skinny_matmul(x, q, experts=experts, scale=s, impl="triton")
  np.testing.assert_allclose(np.asarray(got), _oracle(x, q, experts, s), **TOL[dtype])
  want = skinny_matmul(x, q, experts=experts, scale=s, impl="xla")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_int8_float_bits_are_exact_and_the_kernels_agree_with_the_cast(dtype, monkeypatch, row_form_at_any_size):
  """weights_as gives every int8 value exactly in either dtype, so the kernels' products by float bits equal those
  by a cast to float32 rounding (the one-row form and the one-kernel row FFN; the dot form always casts)."""
  from sparsejax.kernels.skinny_matmul import skinny_ffn, triton
  v = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
  got = triton.weights_as(v, dtype)
  assert got.dtype == dtype and np.array_equal(np.asarray(got, np.float32), np.arange(-128, 128))
  seed = seed_of("int8 bits", str(dtype))
  q, s = quantize_weight(_draw(seed + 1, (3, 256, 384), jnp.float32))
  q2, s2 = quantize_weight(_draw(seed + 2, (3, 384, 256), jnp.float32))
  experts = jnp.asarray([2, 0], jnp.int32)
  assert _form(1, 256, 384, w_dtype=jnp.int8) == "row"
  outs = []
  for magic in (True, False):
    monkeypatch.setattr(triton, "INT8_FLOAT_BITS", magic)
    outs.append([np.asarray(skinny_matmul(_draw(seed, (m, 256), dtype), q, experts=experts, scale=s, impl="triton"))
                 for m in (1,)]
                + [np.asarray(skinny_ffn(_draw(seed, (1, 256), dtype), q, q2, experts=experts[:1], w_in_scale=s,
                                         w_out_scale=s2, activation=jax.nn.gelu, impl="triton"))])
  for a, b in zip(*outs):  # float32 rounding: XLA may order a sum differently around either conversion
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_dense_weight_and_mixed_dtypes():
  """w [k, n] with no experts; float32 weights under bf16 rows are cast where loaded, as w.astype(bf16)."""
  x = _draw(7, (1, 384), jnp.bfloat16)
  w = _draw(8, (384, 320), jnp.float32)
  got = skinny_matmul(x, w, impl="triton")
  assert got.shape == (1, 320)
  np.testing.assert_allclose(np.asarray(got), _oracle(x, w[None], jnp.zeros(1, jnp.int32))[0], **TOL[jnp.bfloat16])
  np.testing.assert_allclose(np.asarray(got), np.asarray(skinny_matmul(x, w, impl="xla")), **TOL[jnp.bfloat16])


def test_dense_weight_takes_leading_dimensions_as_rows():
  """w [k, n]: x [b, t, k] is b * t rows, as in jnp.dot; the kernel's rows count against MAX_ROWS."""
  x = _draw(11, (2, 3, 384), jnp.float32)
  w = _draw(12, (384, 320), jnp.float32)
  got = skinny_matmul(x, w, impl="triton")
  assert got.shape == (2, 3, 320)
  want = _oracle(x.reshape(6, 384), w[None], jnp.zeros(1, jnp.int32))[0].reshape(2, 3, 320)
  np.testing.assert_allclose(np.asarray(got), want, **TOL[jnp.float32])
  with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
    skinny_matmul(jnp.zeros((2, MAX_ROWS, 16)), jnp.zeros((16, 16)), impl="triton")


def test_auto_off_the_gpu_and_odd_shapes_use_the_reference():
  x = _draw(9, (2, 40), jnp.float32)  # 40: not a multiple of 16, no kernel tiling
  w = _draw(10, (3, 40, 24), jnp.float32)
  experts = jnp.asarray([1, 2], jnp.int32)
  assert default_config(2, 40, 24) is None
  np.testing.assert_allclose(np.asarray(skinny_matmul(x, w, experts=experts)), _oracle(x, w, experts), rtol=1e-5,
                             atol=1e-6)


def test_gradients_equal_the_reference():
  x = _draw(11, (3, 384), jnp.float32)
  w = _draw(12, (4, 384, 320), jnp.float32)
  experts = jnp.asarray([1, 3, 1], jnp.int32)
  g = _draw(13, (3, 3, 320), jnp.float32)
  loss = lambda f: lambda x, w: jnp.sum(f(x, w) * g)
  got = jax.jit(jax.grad(loss(lambda x, w: skinny_matmul(x, w, experts=experts, impl="triton")), argnums=(0, 1)))(x, w)
  want = jax.jit(jax.grad(loss(lambda x, w: skinny_matmul_reference(jnp.broadcast_to(x, (3,) + x.shape), w, experts)),
                          argnums=(0, 1)))(x, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_bad_inputs_fail_with_clear_errors():
  x = jnp.ones((2, 64), jnp.float32)
  w = jnp.ones((3, 64, 32), jnp.float32)
  ids = jnp.asarray([0, 1], jnp.int32)
  with pytest.raises(ValueError, match="impl must be one of"):
    skinny_matmul(x, w, experts=ids, impl="cuda")
  with pytest.raises(ValueError, match="give experts"):
    skinny_matmul(x, w)
  with pytest.raises(ValueError, match="experts selects from w"):
    skinny_matmul(x, w[0], experts=ids)
  with pytest.raises(ValueError, match="x has k=63"):
    skinny_matmul(x[:, :63], w, experts=ids)
  with pytest.raises(ValueError, match="but experts has 2 slots"):
    skinny_matmul(jnp.ones((3, 2, 64)), w, experts=ids)
  with pytest.raises(TypeError, match="experts must be an integer"):
    skinny_matmul(x, w, experts=ids.astype(jnp.float32))
  q = jnp.swapaxes(w, 1, 2).astype(jnp.int8)  # int8 is stored k-major: [experts, n, k]
  with pytest.raises(ValueError, match="int8 w needs scale"):
    skinny_matmul(x, q, experts=ids)
  with pytest.raises(ValueError, match=r"scale must have shape \(3, 32\)"):
    skinny_matmul(x, q, experts=ids, scale=jnp.ones((32,)))
  with pytest.raises(ValueError, match=r"x has k=64 but w is \[e, 64, 32\] \(int8: k-major\)"):
    skinny_matmul(x, w.astype(jnp.int8), experts=ids, scale=jnp.ones((3, 32)))  # n-major int8: the wrong layout
  with pytest.raises(TypeError, match="w must be a floating"):
    skinny_matmul(x, w.astype(jnp.int32), experts=ids)
  with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
    skinny_matmul(jnp.ones((MAX_ROWS + 1, 64)), w, experts=ids, impl="triton")
  with pytest.raises(ValueError, match="multiples of 16"):
    skinny_matmul(jnp.ones((2, 40)), jnp.ones((3, 40, 32)), experts=ids, impl="triton")


def _rms64(x, g, eps=1e-6):
  """float64 RMSNorm (the oracle's)."""
  x64 = np.asarray(x, np.float64)
  return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * np.asarray(g, np.float64)


# (x shape, w shape, slot ids or None): rows whose norm the kernel folds in (one row, one row of k = 384, loaded
# as a masked block of 512, and 5 rows padded to 16 on the dot path), a dense weight with [b, t, k] rows, and
# two rows of 384 (16 padded rows of 512 a program: past 4,096 numbers), where the op takes the norm in XLA first.
NORM_CASES = {
    "one_row": ((1, 256), (3, 256, 320), [2, 0]),
    "one_row_not_a_power_of_two": ((1, 384), (3, 384, 320), [2, 0]),
    "few_rows": ((5, 256), (2, 256, 192), [1]),
    "dense_rows": ((2, 3, 128), (128, 320), None),
    "norm_not_folded": ((2, 384), (2, 384, 64), [0, 1]),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(NORM_CASES))
def test_folded_norm_equals_norm_then_product(name, dtype):
  """skinny_matmul(x, w, norm=(g, eps)) = rms_norm(x, g, eps) @ w: float32 to float32 rounding, bf16 to
  bf16's (the kernel rounds x * g where the unfused norm rounds its output)."""
  from sparsejax.kernels.skinny_matmul import triton
  xs, ws, ids = NORM_CASES[name]
  seed = seed_of("norm", name, str(dtype))
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal(xs) * 3.0, dtype)
  w = _draw(seed + 1, ws, dtype)
  g = jnp.asarray(1.0 + 0.3 * rng.standard_normal(xs[-1]), jnp.float32)
  experts = None if ids is None else jnp.asarray(ids, jnp.int32)
  got = jax.jit(lambda x, w, g: skinny_matmul(x, w, experts=experts, norm=(g, 1e-6), impl="triton"))(x, w, g)
  xn = _rms64(x.astype(jnp.float32), g)
  if ids is None:
    want = xn @ np.asarray(w.astype(jnp.float32), np.float64)
  else:
    want = _oracle(jnp.asarray(xn, jnp.float32).astype(dtype), w, experts) if dtype == jnp.bfloat16 else \
        np.einsum("mk,skn->smn", xn, np.asarray(w, np.float64)[np.asarray(ids)])
  np.testing.assert_allclose(np.asarray(got), want, **TOL[dtype])
  m = int(np.prod(xs[:-1]))
  assert triton.norm_fits(m, xs[-1]) == (name != "norm_not_folded")


def test_folded_norm_gradients_equal_the_reference():
  from sparsejax.norm import rms_norm
  rng = np.random.default_rng(21)
  x = jnp.asarray(rng.standard_normal((2, 256)) * 2.0, jnp.float32)
  w = _draw(22, (3, 256, 192), jnp.float32)
  gn = jnp.asarray(1.0 + 0.3 * rng.standard_normal(256), jnp.float32)
  experts = jnp.asarray([2, 0], jnp.int32)
  ct = _draw(23, (2, 2, 192), jnp.float32)
  folded = lambda x, w, gn: skinny_matmul(x, w, experts=experts, norm=(gn, 1e-6), impl="triton")
  got = jax.jit(jax.grad(lambda x, w, gn: jnp.sum(folded(x, w, gn) * ct), argnums=(0, 1, 2)))(x, w, gn)
  want = jax.jit(jax.grad(lambda x, w, gn: jnp.sum(skinny_matmul_reference(
      jnp.broadcast_to(rms_norm(x, gn, 1e-6), (2, 2, 256)), w, experts) * ct), argnums=(0, 1, 2)))(x, w, gn)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_folded_norm_errors():
  x, w, ids = jnp.ones((2, 64)), jnp.ones((3, 64, 32)), jnp.asarray([0, 1], jnp.int32)
  with pytest.raises(ValueError, match=r"scale must have shape \(64,\)"):
    skinny_matmul(x, w, experts=ids, norm=(jnp.ones((32,)), 1e-6))
  with pytest.raises(ValueError, match="not to per-slot rows"):
    skinny_matmul(jnp.ones((2, 2, 64)), w, experts=ids, norm=(jnp.ones((64,)), 1e-6))


def test_folds_norm_where_the_kernel_runs_on_small_rows():
  from sparsejax.kernels.skinny_matmul import folds_norm
  assert folds_norm(1, 1024, 4096, "triton")  # one row
  assert folds_norm(8, 256, 64, "triton")  # 16 padded rows of 256
  assert not folds_norm(32, 512, 2048, "triton")  # 16,384 numbers a program: XLA normalizes first
  assert folds_norm(1, 768, 3072, "triton")  # small-moe's d: a masked block of 1,024
  assert not folds_norm(2, 384, 64, "triton") and not folds_norm(1, 1024, 64, "xla")
  assert folds_norm(1, 1024, 4096) == (jax.default_backend() == "gpu")
  assert not folds_norm(1, 1024, 100)  # no tiles for n = 100: XLA runs the product, and the norm


def _gelu64(x):
  return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _silu64(x):
  return x / (1.0 + np.exp(-x))


def _ffn_oracle(x, w_in, w_out, ids, act, w_gate=None, scales=(None, None, None), dtype=jnp.float32):
  """float64 feed-forward per slot, with h rounded to dtype as the two-call form rounds it."""
  s_in, s_gate, s_out = scales
  u = _oracle(x, w_in, ids, s_in)
  if w_gate is not None:
    h = act(np.asarray(_rounded(_oracle(x, w_gate, ids, s_gate), dtype), np.float64)) * np.asarray(
        _rounded(u, dtype), np.float64)
  else:
    h = act(np.asarray(_rounded(u, dtype), np.float64))
  h = np.asarray(_rounded(h, dtype), np.float64)
  return _oracle(_rounded(h, dtype), w_out, ids, s_out)


# (m, d, f, E, ids, form): "row" is one kernel of hidden-layer slabs (one row, d in power-of-two pieces); "split" the
# two kernels with the hidden layer in W_out's loads: one row whose parts (no dot) feed W_out's dot (f > 2048:
# 16 padded rows); five rows (the parts already padded to 16); one row on both multiply-reduce paths. ids past
# [0, E) are slots with no expert (zero rows); 128 slabs at f = 4,096.
FFN_CASES = {
    "split_one_row_into_a_dot": (1, 240, 4096, 3, [2, 0], "split"),  # 128 + 64 + 32 + 16: too many pieces
    "split_few_rows": (5, 256, 384, 4, [1, 3, 1], "split"),
    "split_one_row": (1, 496, 512, 3, [-1, 3, 1], "split"),  # five pieces
    "row": (1, 256, 512, 3, [-1, 3, 1], "row"),
    "row_many_slabs": (1, 64, 4096, 3, [2, 0], "row"),
    "row_d_in_two_pieces": (1, 384, 512, 3, [1, -1, 0], "row"),  # 256 + 128, as small's 768 is 512 + 256
    "row_d_in_three_pieces": (1, 448, 256, 2, [1], "row"),  # 256 + 128 + 64
    # 32 rows of parts are too many for W_out's programs, but W_in's take all of d: h in W_in's epilogue
    "epilogue": (32, 256, 512, 4, [1, 3, -1, 0], "epilogue"),
    "epilogue_padded_rows": (20, 256, 512, 2, [1, 0], "epilogue"),
}


def _form(m, d, f, act=jax.nn.gelu, w_dtype=jnp.float32, gated=False, slots=1):
  from sparsejax.kernels.skinny_matmul import activates_in_first, fuses_hidden, runs_row_ffn
  if runs_row_ffn(m, d, f, act, "triton", w_dtype, gated, slots):
    return "row"
  if fuses_hidden(m, d, f, act, "triton", slots):
    return "split"
  return "epilogue" if activates_in_first(m, d, f, act, "triton", slots, gated) else "two_calls"


def _same_rounding(dtype) -> dict:
  """How close a kernel form of skinny_ffn is to the two-call form: both round u to dtype before the activation,
  so in bf16 within 1e-3. Except that a GPU's XLA may keep the two-call form's u in float32
  (xla_allow_excess_precision, on by default): on an H200 an epilogue case differed by up to 9e-3 there, and every
  form passed at 1e-3 with that flag off (experiments/notes_decode.md, forty-eighth session). So on a GPU, bf16's
  tolerance; the float64 oracle checks the kernels' rounding itself."""
  if dtype == jnp.float32:
    return TOL[jnp.float32]
  return TOL[dtype] if jax.default_backend() == "gpu" else dict(rtol=1e-3, atol=1e-3)

@pytest.fixture
def row_form_at_any_size(monkeypatch):
  """The one-kernel form for the tests' small feed-forwards too, at the width set: it asks for most of a wave of
  programs (MIN_PROGRAMS) and narrows its slab to fill one (WAVE_PROGRAMS) only for speed; its answer does not
  depend on how many programs run."""
  from sparsejax.kernels.skinny_matmul import triton_row_ffn
  monkeypatch.setattr(triton_row_ffn, "MIN_PROGRAMS", 1)
  monkeypatch.setattr(triton_row_ffn, "WAVE_PROGRAMS", 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(FFN_CASES))
def test_ffn_with_the_hidden_layer_in_the_kernel_equals_the_oracle(name, dtype, row_form_at_any_size):
  """skinny_ffn as one kernel of slabs, or with W_out's programs summing W_in's split-K parts and applying GELU
  as they load h; against float64."""
  from sparsejax.kernels.skinny_matmul import skinny_ffn
  m, d, f, e, ids, form = FFN_CASES[name]
  seed = seed_of("ffn", name, str(dtype))
  x, w_in, w_out = _draw(seed, (m, d), dtype), _draw(seed + 1, (e, d, f), dtype), _draw(seed + 2, (e, f, d), dtype)
  experts = jnp.asarray(ids, jnp.int32)
  assert _form(m, d, f, w_dtype=dtype, slots=len(ids)) == form
  got = jax.jit(lambda x, a, b: skinny_ffn(x, a, b, experts=experts, impl="triton"))(x, w_in, w_out)
  assert got.dtype == jnp.float32 and got.shape == (len(ids), m, d)
  want = _ffn_oracle(x, w_in, w_out, experts, _gelu64, dtype=dtype)
  present = (np.asarray(ids) >= 0) & (np.asarray(ids) < e)
  assert not np.any(want[~present]) and np.all(np.any(want[present], axis=-1))
  np.testing.assert_allclose(np.asarray(got), want, **TOL[dtype])
  two_calls = jax.jit(lambda x, a, b: skinny_ffn(x, a, b, experts=experts, impl="xla"))(x, w_in, w_out)
  # The forms round h alike (the activation in float32 on u rounded to dtype), so they agree far
  # inside bf16's tolerance; a bf16 GELU in bf16 arithmetic was off by up to 7e-3 here.
  np.testing.assert_allclose(np.asarray(got), np.asarray(two_calls), **_same_rounding(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d,form,slab", [(256, "row", 32), (256, "row", 16), (384, "row", 32), (2048, "split", 32)])
def test_ffn_gated_int8_and_folded_norm_in_the_kernels(d, form, slab, dtype, row_form_at_any_size, monkeypatch):
  """SiLU-GLU with int8 experts and their scales, the norm folded into the kernels: the one-kernel form (at the
  library's slab width and at 16-byte slabs, the width an A-B may try; at d 384, k-major slabs and the norm's row in
  pieces of 256 and 128), and the split form (where a program's three slabs of d = 2,048 rows would not fit) in
  W_in's and W_gate's programs."""
  from sparsejax.kernels.skinny_matmul import folds_norm, skinny_ffn, triton_row_ffn
  monkeypatch.setattr(triton_row_ffn, "SLAB_ROW_BYTES_INT8", slab)
  seed = seed_of("ffn_glu", str(dtype), str(d))
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((1, d)) * 2.0, dtype)
  g = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), jnp.float32)
  (qi, si), (qg, sg), (qo, so) = (quantize_weight(_draw(seed + i, shape, jnp.float32))
                                  for i, shape in enumerate([(3, d, 320), (3, d, 320), (3, 320, d)]))
  assert _form(1, d, 320, jax.nn.silu, jnp.int8, gated=True) == form and folds_norm(1, d, 320, "triton")
  experts = jnp.asarray([2, 0], jnp.int32)
  got = skinny_ffn(x, qi, qo, experts=experts, w_gate=qg, activation=jax.nn.silu, w_in_scale=si, w_gate_scale=sg,
                   w_out_scale=so, norm=(g, 1e-6), impl="triton")
  xn = jnp.asarray(_rms64(x.astype(jnp.float32), g), jnp.float32).astype(dtype)
  want = _ffn_oracle(xn, qi, qo, experts, _silu64, w_gate=qg, scales=(si, sg, so), dtype=dtype)
  np.testing.assert_allclose(np.asarray(got), want, **TOL[dtype])


@pytest.mark.parametrize("w_dtype,f,slots,c,row", [
    (jnp.bfloat16, 4096, 1, 32, True), (jnp.int8, 4096, 1, 32, True),  # medium's f: a wave at the set widths
    (jnp.bfloat16, 2048, 1, 16, True), (jnp.int8, 2048, 1, 16, True),  # xs's f: narrowed to make one
    (jnp.bfloat16, 2048, 2, 32, True),  # two slots make the wave
    (jnp.float32, 2048, 1, 16, True),  # 64-byte rows are 16 columns already
    (jnp.int8, 3072, 1, 32, True), (jnp.bfloat16, 3072, 1, 32, True),  # small's f: 96 programs; 192 overflow a wave
    (jnp.bfloat16, 1536, 1, 16, True),  # 48 programs at 32 columns, 96 at 16
    (jnp.bfloat16, 1024, 1, 16, False), (jnp.int8, 1024, 1, 16, False),  # short of MIN_PROGRAMS at the narrowest slab
])
def test_the_row_slab_narrows_only_to_make_a_wave(w_dtype, f, slots, c, row):
  """slab_columns keeps the set width unless twice its programs still fit a wave (WAVE_PROGRAMS), and then halves
  it (to MIN_SLAB_COLUMNS at most); a feed-forward short of MIN_PROGRAMS at that width takes the split form (d 512,
  the library's constants)."""
  from sparsejax.kernels.skinny_matmul import triton_row_ffn
  assert triton_row_ffn.slab_columns(w_dtype, f, slots) == c
  assert triton_row_ffn.fits(1, 512, f, w_dtype, False, slots) == row


@pytest.mark.parametrize("d,want", [(1024, [(0, 1024)]), (768, [(0, 512), (512, 256)]), (96, [(0, 64), (64, 32)]),
                                    (448, [(0, 256), (256, 128), (384, 64)]), (1, [(0, 1)])])
def test_a_row_in_power_of_two_pieces(d, want):
  """whole_row.pieces: d's binary digits, largest first, tiling 0..d; a power of two is one piece, the whole axis."""
  from sparsejax.kernels import whole_row
  assert list(whole_row.pieces(d)) == want
  index = [whole_row.piece_index(d, p) for p in want]
  if len(want) == 1:
    assert index == [slice(None)]
  else:
    assert [(i.start, i.size) for i in index] == want


@pytest.mark.parametrize("w_dtype", [jnp.bfloat16, jnp.int8], ids=["bf16", "int8"])
def test_ffn_row_kernel_at_a_narrowed_slab_equals_the_oracle(w_dtype, monkeypatch):
  """The one-kernel form where the set width leaves a wave mostly idle (8 programs at f 256; MIN_PROGRAMS 16 here):
  at 16-column slabs, against float64, per-channel scales for int8."""
  from sparsejax.kernels.skinny_matmul import skinny_ffn, triton_row_ffn
  monkeypatch.setattr(triton_row_ffn, "MIN_PROGRAMS", 16)
  d, f = 128, 256
  seed = seed_of("ffn_narrow", str(w_dtype))
  x = _draw(seed, (1, d), jnp.bfloat16)
  w_in, w_out = _draw(seed + 1, (3, d, f), jnp.float32), _draw(seed + 2, (3, f, d), jnp.float32)
  if w_dtype == jnp.int8:
    (w_in, s_in), (w_out, s_out) = quantize_weight(w_in), quantize_weight(w_out)
  else:
    w_in, w_out, s_in, s_out = w_in.astype(w_dtype), w_out.astype(w_dtype), None, None
  assert triton_row_ffn.slab_columns(w_dtype, f) == 16 and _form(1, d, f, w_dtype=w_dtype) == "row"
  experts = jnp.asarray([1], jnp.int32)
  got = skinny_ffn(x, w_in, w_out, experts=experts, w_in_scale=s_in, w_out_scale=s_out, impl="triton")
  want = _ffn_oracle(x, w_in, w_out, experts, _gelu64, scales=(s_in, None, s_out), dtype=jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(got), want, **TOL[jnp.bfloat16])


def test_a_patched_slab_width_reaches_a_row_kernel_already_lowered(monkeypatch):
  """An A-B of the row kernel's slab width (ab_decode --patch ...triton_row_ffn:SLAB_ROW_BYTES_INT8=16) lowers B's
  kernel anew: shared_lowering keys on the width (and the wave it narrows to fill), so B gets its own grid, not the
  kernel lowered for A."""
  from sparsejax.kernels.skinny_matmul import triton as skinny, triton_row_ffn
  S, d, f = jax.ShapeDtypeStruct, 256, 1024
  args = [S((1, d), jnp.bfloat16), S((2, f, d), jnp.int8), S((2, d, f), jnp.int8), S((2, f), jnp.float32),
          S((1,), jnp.int32)]

  def programs():  # a new outer trace each time, as B's decoder is
    fn = lambda x, wi, wo, si, ids: triton_row_ffn.row_ffn_parts(
        (x,), skinny.Plain(per_slot=False), wi, None, wo, si, None, ids, jax.nn.gelu, jnp.bfloat16, interpret=False)
    return lower_for_gpu(fn, *args).out_info.shape[1]

  # The wave the slab narrows to fill is a switch too: 32 columns make 32 programs here, and a wave of 64 holds twice
  # that (a wave of 0: no narrowing).
  for width, wave, want in [(32, 0, 32), (16, 0, 64), (32, 0, 32), (32, 64, 64)]:
    monkeypatch.setattr(triton_row_ffn, "SLAB_ROW_BYTES_INT8", width)
    monkeypatch.setattr(triton_row_ffn, "WAVE_PROGRAMS", wave)
    assert programs() == want, (width, wave)


def test_ffn_row_kernel_per_slot_rows_dense_weights_and_gradients(row_form_at_any_size):
  """The one-kernel form with a row per slot, with a dense weight (float32: 16-column slabs), and its
  cotangents (the two-call form's); mixed weight dtypes take the split form."""
  from sparsejax.kernels.skinny_matmul import skinny_ffn
  xs = _draw(61, (3, 1, 128), jnp.float32)
  w_in, w_out = _draw(62, (4, 128, 256), jnp.float32), _draw(63, (4, 256, 128), jnp.float32)
  experts = jnp.asarray([3, 4, 1], jnp.int32)
  assert _form(1, 128, 256) == "row"
  got = skinny_ffn(xs, w_in, w_out, experts=experts, impl="triton")
  want = np.stack([_ffn_oracle(xs[i], w_in, w_out, experts[i:i + 1], _gelu64)[0] for i in range(3)])
  assert not np.any(want[1]) and np.all(np.any(want[[0, 2]], axis=-1))
  np.testing.assert_allclose(np.asarray(got), want, **TOL[jnp.float32])
  x = _draw(64, (1, 128), jnp.float32)
  dense = skinny_ffn(x, w_in[2], w_out[2], impl="triton")
  np.testing.assert_allclose(np.asarray(dense), _ffn_oracle(x, w_in[2:3], w_out[2:3], jnp.zeros(1, jnp.int32),
                                                            _gelu64)[0], **TOL[jnp.float32])
  ct = _draw(65, (3, 1, 128), jnp.float32)
  loss = lambda impl: lambda *a: jnp.sum(skinny_ffn(*a, experts=experts, impl=impl) * ct)
  got = jax.jit(jax.grad(loss("triton"), argnums=(0, 1, 2)))(xs, w_in, w_out)
  want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(xs, w_in, w_out)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  mixed = skinny_ffn(x, w_in.astype(jnp.bfloat16), w_out, experts=experts[:1], impl="triton")
  want = _ffn_oracle(x, w_in.astype(jnp.bfloat16).astype(jnp.float32), w_out, experts[:1], _gelu64)
  np.testing.assert_allclose(np.asarray(mixed), want, **TOL[jnp.float32])


def test_ffn_dense_weights_and_the_unfused_cases():
  """A dense MLP ([d, f] weights, x [b, t, d]); exact GELU (no kernel body for erf) and hidden layers too
  large for a program take the two-call form, with the same answer."""
  from sparsejax.activations import gelu_exact
  from sparsejax.kernels.skinny_matmul import fuses_hidden, fuses_residual, skinny_ffn
  x = _draw(31, (2, 3, 128), jnp.float32)
  w_in, w_out = _draw(32, (128, 256), jnp.float32), _draw(33, (256, 128), jnp.float32)
  got = skinny_ffn(x, w_in, w_out, impl="triton")
  want = _ffn_oracle(x.reshape(6, 128), w_in[None], w_out[None], jnp.zeros(1, jnp.int32), _gelu64)[0]
  np.testing.assert_allclose(np.asarray(got).reshape(6, 128), want, **TOL[jnp.float32])
  assert not fuses_hidden(6, 128, 256, gelu_exact, "triton")
  exact = skinny_ffn(x, w_in, w_out, activation=gelu_exact, impl="triton")
  np.testing.assert_allclose(np.asarray(exact), np.asarray(skinny_ffn(x, w_in, w_out, activation=gelu_exact,
                                                                      impl="xla")), rtol=1e-5, atol=1e-5)
  assert fuses_hidden(1, 1024, 4096, jax.nn.gelu, "triton")  # medium-moe at batch 1: 8 parts x 512 rows
  # ... which runs as one kernel of 128 slabs of 32 columns (d x 64 bytes of W_in and of W_out a program);
  # int8 reads 32-byte rows, 32 columns as bf16's 64 bytes do: medium's int8 experts take the form at one slot
  assert _form(1, 1024, 4096, w_dtype=jnp.bfloat16) == "row" and _form(1, 1024, 4096, w_dtype=jnp.int8) == "row"
  # xs's f 2,048 at one slot: 64 programs at those widths, so 16-column slabs make the wave
  for w_dtype in (jnp.int8, jnp.bfloat16):
    assert _form(1, 512, 2048, w_dtype=w_dtype) == "row" and _form(1, 512, 2048, w_dtype=w_dtype, slots=2) == "row"
  assert _form(1, 512, 1024, w_dtype=jnp.bfloat16) == "split"  # 64 programs even at 16 columns
  assert _form(1, 1024, 4096, w_dtype=jnp.bfloat16, gated=True) == "split"  # three slabs: 192 KB a program
  # small's d 768 as pieces of 512 and 256; f 3,072 at 32 columns makes 96 programs, whose parts the epilogue sums
  # as 64 + 32: small-moe's experts take the row form and its epilogue (what fuses_routing asks of them)
  for w_dtype in (jnp.bfloat16, jnp.int8):
    assert _form(1, 768, 3072, w_dtype=w_dtype) == "row"
    assert fuses_residual(1, 768, 3072, jax.nn.gelu, "triton", w_dtype)
  assert _form(1, 1008, 4096, w_dtype=jnp.bfloat16) != "row"  # 512 + 256 + 128 + 64 + 32 + 16: too many pieces
  assert _form(1, 776, 4096, w_dtype=jnp.bfloat16) == "two_calls"  # not a multiple of 16: no kernel's tiles
  assert _form(2, 1024, 4096, w_dtype=jnp.bfloat16) != "row"  # two rows
  assert not fuses_hidden(32, 1024, 4096, jax.nn.gelu, "triton")  # 32 rows of parts: too many a program
  # medium-moe at batch 32, 16-row groups through up to 32 experts: W_in's 128 x 1,024 tiles take all of d
  assert _form(16, 1024, 4096, w_dtype=jnp.int8, slots=32) == "epilogue"
  assert _form(16, 1024, 4096, w_dtype=jnp.int8, slots=32, gated=True) == "two_calls"  # no gate in an epilogue
  assert _form(32, 1024, 4096, w_dtype=jnp.bfloat16) == "two_calls"  # one weight: four splits of 256 rows
  assert not fuses_hidden(1, 1024, 4096, jax.nn.gelu, "xla")
  # One dense weight whose W_in programs take all of d = 256 at 32 rows: h from W_in's epilogue
  x32, w_in2, w_out2 = _draw(34, (32, 256), jnp.float32), _draw(35, (256, 512), jnp.float32), _draw(36, (512, 256),
                                                                                                   jnp.float32)
  assert _form(32, 256, 512) == "epilogue"
  np.testing.assert_allclose(np.asarray(skinny_ffn(x32, w_in2, w_out2, impl="triton")),
                             np.asarray(skinny_ffn(x32, w_in2, w_out2, impl="xla")), **TOL[jnp.float32])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_ffn_epilogue_with_int8_scales_and_per_slot_rows(dtype, monkeypatch):
  """The decode step's grouped rows at batch 32: x [slots, 20, d] per slot, int8 experts with their scales (W_in's
  scale in its epilogue); against float64, and against the two-call form, which HIDDEN_EPILOGUE = False restores."""
  from sparsejax.kernels.skinny_matmul import op, skinny_ffn
  seed = seed_of("ffn_epilogue", str(dtype))
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((3, 20, 256)), dtype)
  (qi, si), (qo, so) = (quantize_weight(_draw(seed + i, shape, jnp.float32))
                        for i, shape in enumerate([(4, 256, 512), (4, 512, 256)]))
  experts = jnp.asarray([3, 4, 0], jnp.int32)  # 4: a slot with no expert
  assert _form(20, 256, 512, w_dtype=jnp.int8, slots=3) == "epilogue"
  run = lambda: jax.jit(lambda x: skinny_ffn(x, qi, qo, experts=experts, w_in_scale=si, w_out_scale=so,
                                             impl="triton"))(x)
  got = run()
  want = np.stack([_ffn_oracle(x[s], qi, qo, experts[s:s + 1], _gelu64, scales=(si, None, so), dtype=dtype)[0]
                   for s in range(3)])
  assert not np.any(want[1]) and np.all(np.any(want[[0, 2]], axis=-1))
  np.testing.assert_allclose(np.asarray(got), want, **TOL[dtype])
  monkeypatch.setattr(op, "HIDDEN_EPILOGUE", False)
  assert _form(20, 256, 512, w_dtype=jnp.int8, slots=3) == "two_calls"
  np.testing.assert_allclose(np.asarray(got), np.asarray(run()), **_same_rounding(dtype))

def test_ffn_gradients_equal_the_two_call_form():
  from sparsejax.kernels.skinny_matmul import skinny_ffn
  x = _draw(41, (2, 128), jnp.float32)
  w_in, w_gate, w_out = _draw(42, (3, 128, 192), jnp.float32), _draw(43, (3, 128, 192), jnp.float32), \
      _draw(44, (3, 192, 128), jnp.float32)
  experts = jnp.asarray([2, 1], jnp.int32)
  ct = _draw(45, (2, 2, 128), jnp.float32)
  loss = lambda impl: lambda *a: jnp.sum(skinny_ffn(a[0], a[1], a[3], experts=experts, w_gate=a[2],
                                                    activation=jax.nn.silu, impl=impl) * ct)
  got = jax.jit(jax.grad(loss("triton"), argnums=(0, 1, 2, 3)))(x, w_in, w_gate, w_out)
  want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2, 3)))(x, w_in, w_gate, w_out)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_ffn_bad_inputs_fail_with_clear_errors():
  from sparsejax.kernels.skinny_matmul import skinny_ffn
  x, w_in, w_out = jnp.ones((1, 64)), jnp.ones((3, 64, 32)), jnp.ones((3, 32, 64))
  ids = jnp.asarray([0], jnp.int32)
  with pytest.raises(ValueError, match=r"w_out must be \(3, 32, 64\)"):
    skinny_ffn(x, w_in, jnp.ones((3, 64, 32)), experts=ids)
  with pytest.raises(ValueError, match="w_gate must have w_in's shape"):
    skinny_ffn(x, w_in, w_out, experts=ids, w_gate=jnp.ones((3, 64, 16)))
  with pytest.raises(ValueError, match="w_gate_scale given without w_gate"):
    skinny_ffn(x, w_in, w_out, experts=ids, w_gate_scale=jnp.ones((3, 32)))
  with pytest.raises(ValueError, match=r"scale must have shape \(3, 64\)"):
    skinny_ffn(x, jnp.swapaxes(w_in, 1, 2).astype(jnp.int8), jnp.swapaxes(w_out, 1, 2).astype(jnp.int8),
               experts=ids, w_in_scale=jnp.ones((3, 32)), w_out_scale=jnp.ones((64,)))


@pytest.mark.parametrize("m", [1, 2])
def test_ids_outside_the_experts_are_slots_with_no_expert(m):
  """An id past [0, E) gives zero rows on every backend, on the one-row and the dot paths, and zero
  cotangents for its slot (decode_moe pads its distinct experts with E); scales and int8 too."""
  x = _draw(51 + m, (m, 128), jnp.float32)
  q, s = quantize_weight(_draw(52, (3, 128, 64), jnp.float32))
  ids = jnp.asarray([-1, 2, 3, 7, 1], jnp.int32)
  want = _oracle(x, q, ids, s)
  assert not np.any(want[[0, 2, 3]]) and np.all(np.any(want[[1, 4]], axis=-1))
  for impl in ("triton", "xla"):
    got = skinny_matmul(x, q, experts=ids, scale=s, impl=impl)
    np.testing.assert_allclose(np.asarray(got), want, **TOL[jnp.float32])
  w = _draw(53, (3, 128, 64), jnp.float32)
  xs = _draw(54, (5, m, 128), jnp.float32)
  grad = jax.jit(jax.grad(lambda xs, w: jnp.sum(skinny_matmul(xs, w, experts=ids, impl="triton") ** 2),
                          argnums=(0, 1)))
  gx, gw = grad(xs, w)
  assert not np.any(np.asarray(gx)[[0, 2, 3]]) and np.all(np.any(np.asarray(gx)[[1, 4]], axis=-1))
  assert not np.any(np.asarray(gw)[0])


@pytest.mark.parametrize("m,k", [(1, 256), (5, 512)])
def test_split_k_parts_sum_to_the_product(m, k):
  """The parts (several splits; rows padded on the dot path) sum to skinny_matmul; the gradients are the
  product's."""
  from sparsejax.kernels.skinny_matmul import split_k_parts
  x, w = _draw(61 + m, (m, k), jnp.float32), _draw(62 + m, (k, 192), jnp.float32)
  g = jnp.asarray(1.0 + 0.2 * np.random.default_rng(m).standard_normal(k), jnp.float32)
  parts = split_k_parts(x, w, norm=(g, 1e-6), impl="triton")
  assert parts.shape[0] > 1 and parts.shape[1] >= m
  want = skinny_matmul(x, w, norm=(g, 1e-6), impl="xla")
  np.testing.assert_allclose(np.asarray(parts.sum(0)[:m]), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(parts[:, m:]))
  ct = _draw(63, (m, 192), jnp.float32)
  got = jax.jit(jax.grad(lambda x, w: jnp.sum(split_k_parts(x, w, impl="triton").sum(0)[:m] * ct),
                         argnums=(0, 1)))(x, w)
  ref = jax.jit(jax.grad(lambda x, w: jnp.sum(skinny_matmul(x, w, impl="xla") * ct), argnums=(0, 1)))(x, w)
  for a, b in zip(got, ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="dense w"):
    split_k_parts(x, w[None], impl="triton")


def _residual_oracle(y64, combine, residual, dtype):
  """float64 residual + round(sum_s combine[:, s] round(y[s])), round to dtype, the sum to residual's dtype."""
  rnd = lambda v, dt: np.asarray(_rounded(v, dt), np.float64)
  z = np.einsum("ms,smd->md", np.asarray(combine, np.float64), rnd(y64, dtype))
  return rnd(np.asarray(residual, np.float64) + rnd(z, dtype), residual.dtype)


# (d, f, E, ids, w dtype, gated, fused): the row form's epilogue kernel where its parts come in at most
# MAX_PIECES power-of-two pieces (f / slab columns: 16 bf16, 32 float32, 16 int8 slabs; 384 in bf16: 12 = 8 + 4),
# XLA's epilogue where not (f = 480: 15 = 8 + 4 + 2 + 1 bf16 slabs, 30 = 16 + 8 + 4 + 2 float32 ones).
RESIDUAL_CASES = {
    "moe_empty_padded_and_repeated_slots": (256, 512, 3, [-1, 2, 2, 3], None, False, True),
    "one_expert": (128, 512, 1, [0], None, False, True),
    "glu_int8_scales": (256, 512, 3, [2, 0], jnp.int8, True, True),
    "slabs_in_two_pieces": (128, 384, 3, [1, 0], None, False, True),
    "slabs_in_four_pieces": (128, 480, 3, [1, 0], None, False, False),
    "d_in_two_pieces_int8_glu": (384, 512, 3, [2, 0], jnp.int8, True, True),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(RESIDUAL_CASES))
def test_ffn_residual_equals_the_oracle(name, dtype, row_form_at_any_size):
  """skinny_ffn_residual: the row kernel's parts summed, combined over the slots and added to the residual by
  one more kernel (or by XLA where it does not fuse), against float64; the same answer as the XLA backend. A slot
  with no expert (id -1 or E) adds nothing even with a NaN weight (decode_moe_mlp passes the router's as given)."""
  from sparsejax.kernels.skinny_matmul import fuses_residual, skinny_ffn_residual
  d, f, e, ids, w_dtype, gated, fused = RESIDUAL_CASES[name]
  seed = seed_of("ffn_residual", name, str(dtype))
  rng = np.random.default_rng(seed)
  x, residual = _draw(seed, (1, d), dtype), jax.device_put(_rounded(rng.standard_normal((1, d)), dtype))
  valid = (np.asarray(ids) >= 0) & (np.asarray(ids) < e)
  combine = jnp.asarray(np.where(valid, rng.uniform(0.1, 1.0, (1, len(ids))), np.nan), jnp.float32)
  experts = jnp.asarray(ids, jnp.int32)
  ws = [_draw(seed + i, shape, jnp.float32) for i, shape in enumerate([(e, d, f), (e, d, f), (e, f, d)], 1)]
  act = jax.nn.silu if gated else jax.nn.gelu
  if w_dtype == jnp.int8:
    (qi, si), (qg, sg), (qo, so) = (quantize_weight(w) for w in ws)
    kw = dict(w_gate=qg, w_in_scale=si, w_gate_scale=sg, w_out_scale=so)
    w_in, w_out, scales = qi, qo, (si, sg, so)
  else:
    w_in, w_out = (w.astype(dtype) for w in (ws[0], ws[2]))
    kw, scales = dict(w_gate=ws[1].astype(dtype) if gated else None), (None, None, None)
  assert fuses_residual(1, d, f, act, "triton", w_in.dtype, gated, len(ids)) == fused
  call = lambda impl: jax.jit(lambda x, r, c: skinny_ffn_residual(x, w_in, w_out, r, combine=c, experts=experts,
                                                                   activation=act, impl=impl, **kw))
  got = call("triton")(x, residual, combine)
  assert got.dtype == residual.dtype and got.shape == (1, d)
  y = _ffn_oracle(x, w_in, w_out, experts, _silu64 if gated else _gelu64, w_gate=kw["w_gate"], scales=scales,
                  dtype=dtype)
  want = _residual_oracle(y, np.where(valid, combine, 0.0), residual, dtype)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, **TOL[dtype])
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(call("xla")(x, residual, combine), np.float64),
                             **TOL[dtype])


def test_ffn_residual_dense_weights_a_float32_residual_and_gradients(row_form_at_any_size):
  """Dense weights (combine None: one slot of weight 1), a float32 residual stream under bf16 products (the sum
  stays float32), and the cotangents of every input (the reference's) through the epilogue kernel."""
  from sparsejax.kernels.skinny_matmul import fuses_residual, skinny_ffn_residual
  x = _draw(71, (1, 128), jnp.bfloat16)
  w_in, w_out = _draw(72, (128, 512), jnp.bfloat16), _draw(73, (512, 128), jnp.bfloat16)
  residual = _draw(74, (1, 128), jnp.float32)
  assert fuses_residual(1, 128, 512, jax.nn.gelu, "triton", jnp.bfloat16)
  got = skinny_ffn_residual(x, w_in, w_out, residual, impl="triton")
  y = _ffn_oracle(x, w_in[None], w_out[None], jnp.zeros(1, jnp.int32), _gelu64, dtype=jnp.bfloat16)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), _residual_oracle(y, jnp.ones((1, 1)), residual, jnp.bfloat16),
                             **TOL[jnp.bfloat16])
  xs = _draw(75, (1, 128), jnp.float32)
  w3_in, w3_out = _draw(76, (3, 128, 256), jnp.float32), _draw(77, (3, 256, 128), jnp.float32)
  experts, combine = jnp.asarray([2, 0], jnp.int32), jnp.asarray([[0.7, 0.3]], jnp.float32)
  assert fuses_residual(1, 128, 256, jax.nn.gelu, "triton", jnp.float32, slots=2)
  ct = _draw(78, (1, 128), jnp.float32)
  loss = lambda impl: lambda x, a, b, c, r: jnp.sum(
      skinny_ffn_residual(x, a, b, r, combine=c, experts=experts, impl=impl) * ct)
  args = (xs, w3_in, w3_out, combine, _draw(79, (1, 128), jnp.float32))
  got = jax.jit(jax.grad(loss("triton"), argnums=range(5)))(*args)
  want = jax.jit(jax.grad(loss("xla"), argnums=range(5)))(*args)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_ffn_residual_bad_inputs_fail_with_clear_errors():
  from sparsejax.kernels.skinny_matmul import skinny_ffn_residual
  x, w_in, w_out = jnp.ones((1, 64)), jnp.ones((3, 64, 32)), jnp.ones((3, 32, 64))
  ids, r = jnp.asarray([0, 2], jnp.int32), jnp.ones((1, 64))
  with pytest.raises(ValueError, match="combine .* is needed with expert weights"):
    skinny_ffn_residual(x, w_in, w_out, r, experts=ids)
  with pytest.raises(ValueError, match=r"combine must be \[m=1, slots=2\]"):
    skinny_ffn_residual(x, w_in, w_out, r, combine=jnp.ones((1, 3)), experts=ids)
  with pytest.raises(ValueError, match=r"residual must be x's shape \[m=1, d=64\]"):
    skinny_ffn_residual(x, w_in, w_out, jnp.ones((2, 64)), combine=jnp.ones((1, 2)), experts=ids)
  with pytest.raises(ValueError, match=r"takes x \[m, d\]"):
    skinny_ffn_residual(jnp.ones((2, 1, 64)), w_in, w_out, r, combine=jnp.ones((1, 2)), experts=ids)


def _select64(router_parts, k, renormalize):
  """float64: logits = the parts' sum; ids = the k largest (the lower expert first among equal); their softmax."""
  logits = np.asarray(router_parts, np.float64)[0].sum(axis=0)
  p = np.exp(logits - logits.max())
  p /= p.sum()
  ids = np.argsort(-logits, kind="stable")[:k]
  wts = p[ids] / (p[ids].sum() if renormalize else 1.0)
  return ids, wts[None]


# (d, f, E, k, router splits, renormalize, w dtype, gated, fused): the row kernel and its epilogue selecting for
# themselves (f / slab columns in at most MAX_PIECES pieces), and XLA selecting where the epilogue does not fuse
# (15 or 30 slabs: four pieces).
ROUTED_CASES = {
    "top1": (256, 512, 8, 1, 4, False, None, False, True),
    "top2_renormalized_int8_glu": (256, 512, 8, 2, 2, True, jnp.int8, True, True),
    "k_equals_e": (128, 512, 4, 4, 8, True, None, False, True),
    "one_expert": (128, 512, 1, 1, 2, False, None, False, True),
    "slabs_in_two_pieces": (128, 384, 4, 2, 2, True, None, False, True),
    "slabs_in_four_pieces": (128, 480, 4, 2, 2, True, None, False, False),
    "d_in_two_pieces": (384, 256, 8, 2, 4, False, None, False, True),
}


def _routed_case(name, dtype):
  d, f, e, k, splits, renormalize, w_dtype, gated, fused = ROUTED_CASES[name]
  seed = seed_of("routed_ffn", name, str(dtype))
  rng = np.random.default_rng(seed)
  x, residual = _draw(seed, (1, d), dtype), jax.device_put(_rounded(rng.standard_normal((1, d)), dtype))
  parts = jnp.asarray(rng.standard_normal((1, splits, e)), jnp.float32)
  ws = [_draw(seed + i, shape, jnp.float32) for i, shape in enumerate([(e, d, f), (e, d, f), (e, f, d)], 1)]
  if w_dtype == jnp.int8:
    (qi, si), (qg, sg), (qo, so) = (quantize_weight(w) for w in ws)
    kw, w_in, w_out, scales = dict(w_gate=qg, w_in_scale=si, w_gate_scale=sg, w_out_scale=so), qi, qo, (si, sg, so)
  else:
    w_in, w_out = (w.astype(dtype) for w in (ws[0], ws[2]))
    kw, scales = dict(w_gate=ws[1].astype(dtype) if gated else None), (None, None, None)
  return x, residual, parts, w_in, w_out, kw, scales


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(ROUTED_CASES))
def test_routed_ffn_residual_selects_as_the_router_and_equals_the_oracle(name, dtype, row_form_at_any_size):
  """routed_ffn_residual: the row kernel's programs take their slot's expert from the router's partial logits and
  its programs (s, 0) the weights; against float64 (the k largest logits, their softmax), the XLA backend, and the
  ids of select_from_parts, which decode_router's select kernel equals."""
  from sparsejax.kernels.decode_router import select_from_parts
  from sparsejax.kernels.skinny_matmul import fuses_routing, routed_ffn_residual
  d, f, e, k, splits, renormalize, w_dtype, gated, fused = ROUTED_CASES[name]
  x, residual, parts, w_in, w_out, kw, scales = _routed_case(name, dtype)
  act = jax.nn.silu if gated else jax.nn.gelu
  assert fuses_routing(d, f, act, "triton", k, splits, w_in, kw["w_gate"], w_out) == fused
  call = lambda impl: jax.jit(lambda x, r, p: routed_ffn_residual(x, p, w_in, w_out, r, k=k, renormalize=renormalize,
                                                                  activation=act, impl=impl, **kw))
  got, ids = call("triton")(x, residual, parts)
  want_ids, want_wts = _select64(parts, k, renormalize)
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(
      jax.jit(select_from_parts, static_argnums=(1, 2))(parts, k, renormalize)[0][0]))
  assert got.dtype == residual.dtype and got.shape == (1, d) and ids.dtype == jnp.int32
  y = _ffn_oracle(x, w_in, w_out, jnp.asarray(want_ids), _silu64 if gated else _gelu64, w_gate=kw["w_gate"],
                  scales=scales, dtype=dtype)
  np.testing.assert_allclose(np.asarray(got, np.float64), _residual_oracle(y, want_wts, residual, dtype), **TOL[dtype])
  got_xla, ids_xla = call("xla")(x, residual, parts)
  np.testing.assert_array_equal(np.asarray(ids_xla), want_ids)
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(got_xla, np.float64), **TOL[dtype])


def test_routed_ffn_residual_ties_gradients_and_bad_inputs(row_form_at_any_size):
  """Two equal largest logits: the lower expert first, in the kernels as in the reference. The cotangents of
  every input (the reference's, to the router's parts through the weights). Bad inputs: one line each."""
  from sparsejax.kernels.skinny_matmul import routed_ffn_residual
  x, residual, parts, w_in, w_out, kw, _ = _routed_case("top1", jnp.float32)
  tied = parts.at[0, :, 2].set(parts[0, :, 5]).at[0, 0, 5].add(10.0).at[0, 0, 2].add(10.0)
  for impl in ("triton", "xla"):
    _, ids = routed_ffn_residual(x, tied, w_in, w_out, residual, k=2, renormalize=True, impl=impl)
    np.testing.assert_array_equal(np.asarray(ids), [2, 5])
  ct = _draw(81, (1, 256), jnp.float32)
  loss = lambda impl: lambda x, a, b, p, r: jnp.sum(
      routed_ffn_residual(x, p, a, b, r, k=2, renormalize=True, impl=impl)[0] * ct)
  args = (x, w_in, w_out, parts, residual)
  got = jax.jit(jax.grad(loss("triton"), argnums=range(5)))(*args)
  want = jax.jit(jax.grad(loss("xla"), argnums=range(5)))(*args)
  assert float(jnp.max(jnp.abs(want[3]))) > 0  # the weights carry a gradient to the router's parts
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"router_parts \[1, splits, E\]"):
    routed_ffn_residual(x, parts[0], w_in, w_out, residual, k=1, renormalize=False)
  with pytest.raises(ValueError, match=r"router_parts \[1, splits, E\]"):
    routed_ffn_residual(x, parts[:, :, :4], w_in, w_out, residual, k=1, renormalize=False)
  with pytest.raises(ValueError, match="one token"):
    routed_ffn_residual(jnp.ones((2, 256)), parts, w_in, w_out, jnp.ones((2, 256)), k=1, renormalize=False)
  with pytest.raises(ValueError, match=r"residual must be x's shape"):
    routed_ffn_residual(x, parts, w_in, w_out, jnp.ones((1, 128)), k=1, renormalize=False)
  with pytest.raises(ValueError, match="top_k|k="):
    routed_ffn_residual(x, parts, w_in, w_out, residual, k=9, renormalize=False)


def test_tiles_fit_each_gpus_shared_memory(monkeypatch):
  """Triton stops on a pipeline that asks more shared memory than the GPU has. The wide dot tiles (128 columns,
  128 K rows a step, three stages) ask 108-144 KiB at 16-64 padded rows, over the 99 KiB of sm_86 / sm_89 / sm_120
  cards. With the GPU's generation set, every default config fits its card; where the H100 sweep's tiles fit (Hopper,
  the A100, and every tile but the wide ones on 99 KiB cards) they are unchanged."""
  wide = skinny_triton.Config(block_n=128, block_k=128, rows_per_program=2048, use_dot=True)
  assert skinny_triton.pipeline_bytes(wide, 64) == 144 * 1024 and skinny_triton.pipeline_bytes(wide, 2) == 108 * 1024
  shapes = [(k, n, slots) for k, n in ((512, 2048), (1024, 4096), (4096, 1024), (768, 3072), (2048, 8192))
            for slots in (1, 4, 22)]
  for cc, kib in kernels.SHARED_MEMORY_KIB.items():
    if cc < (8, 0):
      continue
    monkeypatch.setattr(kernels, "gpu_compute_capability", lambda cc=cc: f"{cc[0]}.{cc[1]}")
    for m in (1, 2, 16, 32, MAX_ROWS):
      for k, n, slots in shapes:
        cfg, unfitted = default_config(m, k, n, slots), skinny_triton._tiles(m, k, n, slots)
        assert skinny_triton.pipeline_bytes(cfg, m) <= kib * 1024, (cc, m, k, n, slots, cfg)
        assert (cfg == unfitted) == (skinny_triton.pipeline_bytes(unfitted, m) <= kib * 1024), (cc, m, k, n, cfg)
        assert cfg.num_stages == 3 or (kib < 163 and cfg.block_n == 128), (cc, m, k, n, slots, cfg)
    ada = default_config(32, 4096, 1024, 22)
    assert ada == (dataclasses.replace(skinny_triton._tiles(32, 4096, 1024, 22), num_stages=2)
                   if kib == 99 else skinny_triton._tiles(32, 4096, 1024, 22))
