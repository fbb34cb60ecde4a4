"""decode_router: the one-kernel top-k router (interpret mode off the GPU) against a float64 oracle and
the library's routing functions; its gradient; its errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax.kernels.decode_router import (decode_router, decode_router_reference, kernel_fits, router_logit_parts,
                                             runs_kernel, select_from_parts, select_logit_parts, splits_logits)
from sparsejax.kernels.decode_router.triton import Config, default_config
from tests.moe_testing import seed_of

TOL = dict(rtol=1e-5, atol=1e-6)


def _oracle(x, w, k, renormalize):
  """float64: p = softmax(x W), the k largest p (lower index first among equal), renormalized or not."""
  logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  p = np.exp(logits - logits.max(axis=1, keepdims=True))
  p /= p.sum(axis=1, keepdims=True)
  ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
  wts = np.take_along_axis(p, ids, axis=1)
  if renormalize:
    wts /= wts.sum(axis=1, keepdims=True)
  return ids, wts


# (tokens, d_model, experts, k, renormalize): d_model crossing several [block_k, E] tiles (320 is 5 of
# 64, in one program; 768 is 24 of 32, 3 in each of 8 programs), the medium preset's 1024 x 64 (8
# programs of one tile), k = E, one expert, top-1 renormalized (weight 1).
CASES = {
    "decode_top1": (1, 1024, 64, 1, False),
    "tiles_top2": (3, 320, 8, 2, True),
    "k_equals_e": (5, 256, 8, 8, True),
    "k_equals_e_unnormalized": (2, 96, 4, 4, False),
    "one_expert": (2, 64, 1, 1, False),
    "top1_renormalized": (4, 128, 16, 1, True),
    "wide_router": (2, 512, 256, 2, True),
    "splits_of_several_tiles": (2, 768, 16, 2, True),
}


def _case(name, dtype):
  t, d, e, _, _ = CASES[name]
  rng = np.random.default_rng(seed_of(name, str(dtype)))
  x = jnp.asarray(rng.standard_normal((t, d)), dtype)
  w = jnp.asarray(rng.standard_normal((d, e)) * 2.0 / np.sqrt(d), jnp.float32)  # logits of order 1
  return x, w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_oracle_and_the_routing_functions(name, dtype):
  _, _, e, k, renorm = CASES[name]
  x, w = _case(name, dtype)
  ids, wts = jax.jit(lambda x, w: decode_router(x, w, k, renormalize=renorm, impl="triton"))(x, w)
  assert ids.dtype == jnp.int32 and wts.dtype == jnp.float32 and ids.shape == wts.shape == (x.shape[0], k)
  want_ids, want_wts = _oracle(x.astype(jnp.float32), w, k, renorm)
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  np.testing.assert_allclose(np.asarray(wts), want_wts, **TOL)
  ref_ids, ref_wts = jax.jit(decode_router_reference, static_argnums=(2, 3))(x, w, k, renorm)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
  np.testing.assert_allclose(np.asarray(wts), np.asarray(ref_wts), **TOL)


def test_equal_probabilities_take_the_lower_expert_first():
  """Experts 1, 3 and 6 have identical router columns, so identical logits and probabilities: top_k_small's
  order (the kernel takes the k largest logits, lower index first among equal ones)."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((64, 8)) * 0.01
  w[:, [1, 3, 6]] = rng.standard_normal((64, 1)) * 0.5
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  x = x * jnp.sign(x @ jnp.asarray(w[:, 1:2], jnp.float32))  # the shared column's logit is the largest
  ids, wts = decode_router(x, jnp.asarray(w, jnp.float32), 3, impl="triton")
  np.testing.assert_array_equal(np.asarray(ids), [[1, 3, 6]] * 3)
  np.testing.assert_allclose(np.asarray(wts), 1 / 3, rtol=1e-6)


def test_gradients_are_the_references():
  x, w = _case("tiles_top2", jnp.float32)
  r = jnp.asarray(np.random.default_rng(1).standard_normal((3, 2)), jnp.float32)
  loss = lambda impl: lambda x, w: jnp.sum(decode_router(x, w, 2, impl=impl)[1] * r)
  got = jax.jit(jax.grad(loss("triton"), argnums=(0, 1)))(x, w)
  want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1)))(x, w)
  for g, h in zip(got, want):
    assert float(jnp.max(jnp.abs(h))) > 0
    np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", ["triton", "auto"])
def test_no_tokens_give_empty_answers(impl):
  ids, wts = decode_router(jnp.zeros((0, 64)), jnp.ones((64, 8)), 2, impl=impl)
  assert ids.shape == wts.shape == (0, 2) and ids.dtype == jnp.int32 and wts.dtype == jnp.float32


def test_auto_takes_the_reference_off_the_gpu():
  x, w = _case("decode_top1", jnp.float32)
  text = str(jax.make_jaxpr(lambda x, w: decode_router(x, w, 1))(x, w))
  on_gpu = jax.default_backend() == "gpu"
  assert ("pallas_call" in text) == on_gpu == runs_kernel(1, 1024, 64, 1)


def test_runs_kernel():
  assert runs_kernel(1, 320, 8, 2, impl="triton") and not runs_kernel(1, 1024, 64, 1, impl="xla")
  assert not runs_kernel(0, 1024, 64, 1, impl="triton")  # no tokens: the reference
  on_gpu = jax.default_backend() == "gpu"
  assert runs_kernel(64, 1024, 64, 1) == on_gpu and not runs_kernel(65, 1024, 64, 1)  # past a decode batch
  assert not runs_kernel(1, 320, 8, 2)  # 5 tiles of W_r in one program: left to XLA
  assert not runs_kernel(1, 1024, 60, 1)  # the kernel does not fit


def test_config_splits_w_r_over_programs():
  """One tile a program where the tiles are a power of two (the medium preset: 8 of [128, 64]; xs: 4), the
  largest power of two dividing them otherwise, with smaller tiles where that leaves fewer than MIN_SPLITS
  programs (small's 768: 2 programs of [128, 64] tiles, 8 of [32, 64]), one program for an odd count that no
  tile size splits into MIN_SPLITS; the cases above take both forms."""
  assert default_config(1024, 64) == Config(block_k=128, splits=8)
  assert default_config(512, 64) == Config(block_k=128, splits=4)
  assert default_config(768, 64) == Config(block_k=32, splits=8)
  assert default_config(1536, 64) == Config(block_k=64, splits=8)
  assert default_config(512, 256) == Config(block_k=32, splits=16)
  assert default_config(320, 8).splits == 1
  forms = {default_config(d, e).splits > 1 for _, d, e, _, _ in CASES.values()}
  assert forms == {True, False}


def test_kernel_fits():
  assert kernel_fits(1024, 64, 1) and kernel_fits(16, 1, 1)
  assert not kernel_fits(1024, 60, 1)  # not a power of two
  assert not kernel_fits(1024, 64, 9)  # past top_k_small's passes
  assert not kernel_fits(1000, 64, 1)  # no block divides d_model


@pytest.mark.parametrize("args,kwargs,err,msg", [
    ((jnp.zeros((2, 8)), jnp.zeros((8, 4)), 1), dict(impl="cuda"), ValueError, "impl must be one of"),
    ((jnp.zeros((2, 8)), jnp.zeros((6, 4)), 1), {}, ValueError, "d_model=8 but w_router expects 6"),
    ((jnp.zeros((8,)), jnp.zeros((8, 4)), 1), {}, ValueError, "x must have rank 2"),
    ((jnp.zeros((2, 8)), jnp.zeros((8, 4)), 5), {}, ValueError, "exceeds the number of experts"),
    ((jnp.zeros((2, 8)), jnp.zeros((8, 4)), 1.0), {}, TypeError, "k must be a Python int"),
    ((jnp.zeros((2, 16), jnp.int32), jnp.zeros((16, 4)), 1), {}, (TypeError, ValueError), "x"),
    ((jnp.zeros((2, 16)), jnp.zeros((16, 6)), 1), dict(impl="triton"), ValueError, "power-of-two expert count"),
])
def test_bad_inputs_fail_with_one_line(args, kwargs, err, msg):
  with pytest.raises(err, match=msg) as info:
    decode_router(*args, **kwargs)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["decode_top1", "tiles_top2", "k_equals_e", "splits_of_several_tiles"])
def test_folded_norm_routes_the_normalized_rows(name, dtype):
  """norm=(g, eps) routes rms_norm(x, g, eps), rounded to x's dtype as the model's norm rounds it: the ids
  of the float64 oracle on those rows, and the reference's weights. (320 and 768 are not powers of two: the
  kernel loads the row as a masked block of 512 or 1,024.)"""
  from sparsejax.kernels.decode_router.triton import norm_fits
  from sparsejax.norm import rms_norm
  _, d, e, k, renorm = CASES[name]
  x, w = _case(name, dtype)
  x = x * 3.0
  g = jnp.asarray(1.0 + 0.3 * np.random.default_rng(seed_of("g", name)).standard_normal(d), jnp.float32)
  ids, wts = jax.jit(lambda x, w, g: decode_router(x, w, k, renormalize=renorm, norm=(g, 1e-6),
                                                   impl="triton"))(x, w, g)
  xn = jax.jit(rms_norm, static_argnums=2)(x, g, 1e-6)
  want_ids, want_wts = _oracle(xn.astype(jnp.float32), w, k, renorm)
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  np.testing.assert_allclose(np.asarray(wts), want_wts, **TOL)
  assert norm_fits(d)
  # Its gradient is the reference's on the normalized rows, in x, W_r and g.
  f = lambda impl: jax.jit(jax.grad(lambda x, w, g: jnp.sum(decode_router(
      x.astype(dtype), w, k, renormalize=renorm, norm=(g, 1e-6), impl=impl)[1] ** 2), argnums=(0, 1, 2)))
  # bf16 rows: the kernel's weights (the cotangent's source) differ from XLA's in the last float32
  # bits, which can flip a bf16 rounding in the backward's rms_norm (an H100 run saw 0.6% on 4 of
  # 1,536 entries of dx, 1.5e-5 absolute).
  tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-5)
  for a, b in zip(f("triton")(x.astype(jnp.float32), w, g), f("xla")(x.astype(jnp.float32), w, g)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)


def test_folded_norm_scale_of_the_wrong_width_is_an_error():
  x, w = _case("tiles_top2", jnp.float32)
  with pytest.raises(ValueError, match=r"scale must have shape \(320,\)"):
    decode_router(x, w, 2, norm=(jnp.ones((32,)), 1e-6))


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("name", ["decode_top1", "k_equals_e", "splits_of_several_tiles", "wide_router"])
def test_logit_parts_are_the_first_kernel_and_select_as_the_router(name, norm):
  """router_logit_parts: split s's partial logits against float64; selected from (select_from_parts, the rule the
  experts' kernels apply to them) they give decode_router's ids and weights."""
  t, d, e, k, renorm = CASES[name]
  x, w = _case(name, jnp.float32)
  g = jnp.asarray(1 + 0.1 * np.random.default_rng(3).standard_normal(d), jnp.float32)
  nrm = (g, 1e-6) if norm else None
  parts = jax.jit(lambda x, w: router_logit_parts(x, w, norm=nrm))(x, w)
  splits = default_config(d, e).splits
  assert parts.shape == (t, splits, e) and parts.dtype == jnp.float32 and splits > 1
  xn = np.asarray(x, np.float64)
  if norm:
    xn = xn / np.sqrt(np.mean(xn * xn, axis=1, keepdims=True) + 1e-6) * np.asarray(g, np.float64)
  want = np.einsum("tsr,sre->tse", xn.reshape(t, splits, -1), np.asarray(w, np.float64).reshape(splits, -1, e))
  np.testing.assert_allclose(np.asarray(parts), want, rtol=1e-5, atol=1e-5)
  # Each jitted: op by op, every case's shapes compiled dozens of small programs.
  want_ids, want_wts = jax.jit(lambda x, w: decode_router(x, w, k, renormalize=renorm, norm=nrm, impl="triton"))(x, w)
  for ids, wts in (jax.jit(select_from_parts, static_argnums=(1, 2))(parts, k, renorm),
                   jax.jit(lambda p: select_logit_parts(p, k, renormalize=renorm))(parts)):
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(wts), np.asarray(want_wts), **TOL)


def test_logit_parts_gradients_and_errors():
  x, w = _case("splits_of_several_tiles", jnp.float32)
  g = jnp.asarray(np.random.default_rng(4).uniform(0.5, 1.5, 768), jnp.float32)
  splits = default_config(768, 16).splits  # 8 programs of three [32, 16] tiles
  assert splits == 8
  ct = jnp.asarray(np.random.default_rng(5).standard_normal((2, splits, 16)), jnp.float32)
  from sparsejax.kernels.decode_router.reference import logit_parts_reference
  from sparsejax.norm import rms_norm
  got = jax.jit(jax.grad(lambda x, w, g: jnp.sum(router_logit_parts(x, w, norm=(g, 1e-6)) * ct),
                         argnums=(0, 1, 2)))(x, w, g)
  want = jax.jit(jax.grad(lambda x, w, g: jnp.sum(logit_parts_reference(rms_norm(x, g, 1e-6), w, splits) * ct),
                          argnums=(0, 1, 2)))(x, w, g)
  for a, b in zip(got, want):
    assert float(jnp.max(jnp.abs(b))) > 0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="W_r over several programs") as info:
    router_logit_parts(jnp.ones((1, 320)), jnp.ones((320, 8)))  # 5 tiles: one program
  assert "\n" not in str(info.value)
  assert splits_logits(1, 1024, 64, 1, impl="triton") and not splits_logits(1, 64, 8, 1, impl="triton")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["decode_top1", "splits_of_several_tiles"])
def test_logit_parts_add_a_pending_product_first(name, dtype):
  """pending: a product's split-K parts that the router's programs add to x (as x + product.astype(x.dtype)
  rounds it) before the norm; the sum h comes back for the layer's other kernels. Against float64, and against
  XLA's add then the plain kernel; the cotangents are the reference's, to x, W_r, g and the parts. (d 768 is not
  a power of two: the kernel loads and stores its row as a masked block of 1,024.)"""
  t, d, e, _, _ = CASES[name]
  x, w = _case(name, dtype)
  rng = np.random.default_rng(seed_of("pending", name, str(dtype)))
  pending = jnp.asarray(rng.standard_normal((4, 16, d)) * 0.5, jnp.float32)  # 4 parts, rows padded to 16
  g = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32)
  parts, h = jax.jit(lambda x, w, g, p: router_logit_parts(x, w, norm=(g, 1e-6), pending=p))(x, w, g, pending)
  rnd = lambda v: np.asarray(jnp.asarray(v, dtype), np.float64)
  want_h = rnd(np.asarray(x, np.float64) + rnd(np.asarray(pending, np.float64).sum(axis=0)[:t]))
  assert h.dtype == dtype and h.shape == x.shape
  np.testing.assert_allclose(np.asarray(h, np.float64), want_h, **(TOL if dtype == jnp.float32 else dict(rtol=1e-2)))
  # bf16: the normalized row's rounding may flip an ulp between the two programs (a logit moves ~1e-2)
  np.testing.assert_allclose(np.asarray(parts), np.asarray(jax.jit(lambda h, w, g: router_logit_parts(
                                 h, w, norm=(g, 1e-6)))(h, w, g)),
                             **(TOL if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)))
  if dtype == jnp.float32:
    ct = jnp.asarray(rng.standard_normal(parts.shape), jnp.float32)
    ch = jnp.asarray(rng.standard_normal(h.shape), jnp.float32)

    def loss(fn):
      return lambda x, w, g, p: sum(jnp.sum(a * c) for a, c in zip(fn(x, w, g, p), (ct, ch)))

    from sparsejax.kernels.decode_router.op import _added
    from sparsejax.kernels.decode_router.reference import logit_parts_reference
    from sparsejax.norm import rms_norm
    kernel = lambda x, w, g, p: router_logit_parts(x, w, norm=(g, 1e-6), pending=p)
    ref = lambda x, w, g, p: (logit_parts_reference(rms_norm(_added(x, p), g, 1e-6), w, parts.shape[1]), _added(x, p))
    got = jax.jit(jax.grad(loss(kernel), argnums=range(4)))(x, w, g, pending)
    want = jax.jit(jax.grad(loss(ref), argnums=range(4)))(x, w, g, pending)
    for a, b in zip(got, want):
      assert float(jnp.max(jnp.abs(b))) > 0
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_logit_parts_pending_without_a_norm_and_bad_pending():
  """Without a norm the add runs in XLA first (the kernel loads the whole row only for a norm); bad parts fail."""
  x, w = _case("decode_top1", jnp.float32)
  pending = jnp.ones((2, 1, 1024), jnp.float32)
  parts, h = router_logit_parts(x, w, pending=pending)
  np.testing.assert_array_equal(np.asarray(h), np.asarray(x + 2.0))
  np.testing.assert_allclose(np.asarray(parts), np.asarray(router_logit_parts(x + 2.0, w)), rtol=1e-6)
  with pytest.raises(ValueError, match=r"pending must be \[parts, rows >= 1, 1024\]") as info:
    router_logit_parts(x, w, pending=jnp.ones((2, 1, 512)))
  assert "\n" not in str(info.value)
  with pytest.raises(ValueError, match="pending must be"):
    router_logit_parts(x, w, pending=jnp.ones((1, 1024)))


def test_select_logit_parts_gradients_and_errors():
  """The select kernel alone: the weights' cotangents to the parts are the reference's; bad parts fail in one line."""
  parts = jnp.asarray(np.random.default_rng(6).standard_normal((3, 4, 16)), jnp.float32)
  ct = jnp.asarray(np.random.default_rng(7).standard_normal((3, 2)), jnp.float32)
  got = jax.jit(jax.grad(lambda p: jnp.sum(select_logit_parts(p, 2)[1] * ct)))(parts)
  want = jax.jit(jax.grad(lambda p: jnp.sum(select_from_parts(p, 2, True)[1] * ct)))(parts)
  assert float(jnp.max(jnp.abs(want))) > 0
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
  for bad, msg in ((parts[0], "parts must be"), (parts.astype(jnp.int32), "parts")):
    with pytest.raises((TypeError, ValueError), match=msg) as info:
      select_logit_parts(bad, 2)
    assert "\n" not in str(info.value)
  with pytest.raises(ValueError, match="exceeds the number of experts"):
    select_logit_parts(parts, 17)
