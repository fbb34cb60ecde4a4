"""residual_norm: the Pallas Triton kernel (interpret mode off the GPU) against the reference, and the
reference against the unfused layers it replaces (a float64 oracle for the norm and the routing)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import routing
from sparsejax.kernels.residual_norm import pending_delta, residual_norm, residual_norm_reference
from sparsejax.models.transformer import RMSNorm
from tests.moe_testing import seed_of

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
EPS = 1e-6

# (rows, d, slots, splits, padded rows, experts, k, combine): d = 96 and 384 cross several blocks;
# parts carry padded rows past m, as skinny_matmul_parts' dot path returns them.
CASES = {
    "first_layer_no_parts": (3, 96, 0, 0, 0, None, 1, False),
    "attention_one_slot": (1, 384, 1, 8, 16, None, 1, False),
    "moe_top1_router": (1, 384, 1, 8, 16, 64, 1, True),
    "moe_top2_slots_router": (5, 96, 4, 3, 16, 8, 2, True),
    "k_equals_E": (2, 96, 2, 2, 2, 4, 4, True),
    "one_expert": (2, 96, 1, 1, 2, 1, 1, True),
}


def _draw(name, dtype):
  m, d, slots, splits, rows, e, k, comb = CASES[name]
  rng = np.random.default_rng(seed_of(name))
  x = jnp.asarray(rng.standard_normal((m, d)), dtype)
  parts = combine = w = None
  if slots:
    parts = jnp.asarray(rng.standard_normal((slots, splits, rows, d)), jnp.float32)
    if comb:
      combine = jnp.asarray(rng.uniform(0.1, 1.0, (m, slots)), jnp.float32)
  if e:
    w = jnp.asarray(rng.standard_normal((d, e)) / np.sqrt(d), jnp.float32)
  scale = jnp.asarray(rng.uniform(0.5, 1.5, (d,)), jnp.float32)
  return x, parts, combine, scale, w, k


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_reference(name, dtype):
  x, parts, combine, scale, w, k = _draw(name, dtype)
  kw = dict(eps=EPS, w_router=w, k=k, renormalize=k > 1)
  got = residual_norm(x, parts, combine, scale, impl="triton", **kw)
  want = residual_norm_reference(x, parts, combine, scale, **kw)
  assert len(got) == (5 if w is not None else 2)
  for g, r in zip(got, want):
    assert g.dtype == r.dtype and g.shape == r.shape
  # h rounds like the unfused add; n is the norm of that h (one rounding of float32 sums apart).
  np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                             rtol=0, atol=float(jnp.finfo(dtype).eps) * 8)
  np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32), **TOL[dtype])
  if w is not None:
    np.testing.assert_allclose(got[2], want[2], **TOL[jnp.float32])
    np.testing.assert_array_equal(got[3], want[3])
    np.testing.assert_allclose(got[4], want[4], **TOL[jnp.float32])


def test_reference_is_the_unfused_layers():
  """h = x + the layer's rounded output, n = the model's RMSNorm, routing = routing.top_k_routing."""
  x, parts, combine, scale, w, k = _draw("moe_top2_slots_router", jnp.bfloat16)
  h, n, logits, ids, weights = residual_norm_reference(x, parts, combine, scale, eps=EPS, w_router=w, k=k,
                                                       renormalize=True)
  y = jnp.einsum("ms,smd->md", combine, jnp.sum(parts[:, :, :5], 1).astype(jnp.bfloat16).astype(jnp.float32))
  # One bf16 step apart at most: XLA on a GPU may fuse (and so round) float32 sums differently.
  close = dict(rtol=2 ** -7, atol=2 ** -7)
  np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(x + y.astype(jnp.bfloat16), np.float32), **close)
  norm = RMSNorm(x.shape[1], eps=EPS)
  norm.scale[...] = scale
  np.testing.assert_allclose(np.asarray(n, np.float32), np.asarray(norm(h), np.float32), **close)
  r = routing.top_k_routing(routing.router_logits(n, w), k, renormalize=True)
  np.testing.assert_array_equal(ids, r.expert_ids)
  # routing.router_logits' float32 dot runs at the backend's default precision (TF32 on a GPU);
  # the reference's at HIGHEST.
  close = dict(rtol=1e-6, atol=1e-6) if jax.default_backend() == "cpu" else dict(rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(weights, r.combine_weights, **close)
  np.testing.assert_allclose(logits, r.router_logits, **close)


def test_ties_take_the_lowest_expert():
  """A zero router weight makes every logit equal: top-k is then experts 0..k-1, as lax.top_k."""
  x, parts, combine, scale, _, _ = _draw("moe_top2_slots_router", jnp.float32)
  w = jnp.zeros((x.shape[1], 8), jnp.float32)
  _, _, _, ids, weights = residual_norm(x, parts, combine, scale, eps=EPS, w_router=w, k=3, impl="triton")
  np.testing.assert_array_equal(ids, np.tile([0, 1, 2], (x.shape[0], 1)))
  np.testing.assert_allclose(weights, 1 / 8, rtol=1e-6)


def test_pending_delta_of_one_slot_is_the_rounded_sum():
  parts = jnp.asarray(np.random.default_rng(1).standard_normal((1, 3, 4, 8)), jnp.float32)
  np.testing.assert_array_equal(pending_delta(parts, None, 2, jnp.bfloat16),
                                jnp.sum(parts[0, :, :2], 0).astype(jnp.bfloat16))


def test_gradients_equal_the_reference():
  x, parts, combine, scale, w, k = _draw("moe_top2_slots_router", jnp.float32)
  def loss(fn):
    def f(x, parts, combine, scale, w):
      h, n, logits, _, weights = fn(x, parts, combine, scale, eps=EPS, w_router=w, k=k, renormalize=True)
      return jnp.sum(h * h) + jnp.sum(jnp.sin(n)) + jnp.sum(logits ** 2) + jnp.sum(weights * 3)
    return jax.grad(f, argnums=(0, 1, 2, 3, 4))(x, parts, combine, scale, w)
  got = loss(lambda *a, **kw: residual_norm(*a, impl="triton", **kw))
  want = loss(residual_norm_reference)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_auto_off_the_gpu_and_odd_shapes_use_the_reference():
  x, parts, _, scale, _, _ = _draw("attention_one_slot", jnp.float32)
  got = jax.jit(lambda *a: residual_norm(*a, None, scale, eps=EPS))(x, parts)
  want = residual_norm_reference(x, parts, None, scale, eps=EPS)
  if jax.default_backend() == "gpu":  # "auto" is the kernel there
    np.testing.assert_allclose(got[1], want[1], **TOL[jnp.float32])
  else:
    np.testing.assert_array_equal(got[1], want[1])
  odd = jnp.ones((2, 40), jnp.float32)
  with pytest.raises(ValueError, match="impl='triton' needs d a multiple of 16"):
    residual_norm(odd, None, None, jnp.ones((40,)), eps=EPS, impl="triton")
  with pytest.raises(ValueError, match="power-of-two number of experts"):
    residual_norm(x, None, None, scale, eps=EPS, w_router=jnp.ones((384, 6)), impl="triton")


def test_bad_inputs_fail_with_clear_errors():
  x, parts, combine, scale, w, _ = _draw("moe_top2_slots_router", jnp.float32)
  call = lambda **kw: residual_norm(**{"x": x, "parts": parts, "combine": combine, "scale": scale,
                                      "eps": EPS, **kw})
  with pytest.raises(ValueError, match="impl must be one of"):
    call(impl="cuda")
  with pytest.raises(ValueError, match="scale must have shape"):
    call(scale=jnp.ones((3,)))
  with pytest.raises(ValueError, match="parts must be float32"):
    call(parts=parts.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="combine must be"):
    call(combine=combine[:, :2])
  with pytest.raises(ValueError, match="need combine"):
    call(combine=None)
  with pytest.raises(ValueError, match="give parts too"):
    call(parts=None)
  with pytest.raises(ValueError, match="w_router must be"):
    call(w_router=w[:10])
  with pytest.raises(ValueError, match="k"):
    call(w_router=w, k=9)
