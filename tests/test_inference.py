"""Generation with the KV cache: the same tokens as recomputing the full forward, the device loop equal to
single steps, sampling, errors, CLI."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsejax.inference import (Decoder, Sampling, dequantize_model, expert_bytes, generate, generate_timed,
                                 left_pad, quantize_model, sample_logits)
from sparsejax.models import Transformer, TransformerConfig

BASE = TransformerConfig(d_model=32, num_layers=2, num_heads=2, d_ff=64, num_experts=4, top_k=2,
                         max_seq_len=48)
PROMPTS = [[5, 17, 99, 3, 200, 41, 8], [7], [250, 1, 64, 128]]  # different lengths in one batch


def _model(moe_every, seed=0):
  return Transformer(BASE.replace(moe_every=moe_every), rngs=nnx.Rngs(seed))


def greedy_by_full_forward(model, prompts, steps, *, with_logits=False):
  """Recompute the whole forward at every step. Rows are right-padded to one fixed length, so one
  compile serves every step: causal attention and dropless experts keep padding out of real rows.
  with_logits: also the logits each choice was made from, [rows, steps, vocab]."""
  fwd = nnx.jit(lambda m, t: m(t)[0])
  seqs = [list(p) for p in prompts]
  width = max(map(len, prompts)) + steps
  chosen_from = []
  for _ in range(steps):
    batch = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
      batch[i, :len(s)] = s
    logits = np.asarray(fwd(model, jnp.asarray(batch)))
    chosen_from.append(np.stack([logits[i, len(s) - 1] for i, s in enumerate(seqs)]))
    for i, s in enumerate(seqs):
      s.append(int(np.argmax(logits[i, len(s) - 1])))
  tokens = np.array([s[len(p):] for s, p in zip(seqs, prompts)])
  return (tokens, np.stack(chosen_from, 1)) if with_logits else tokens


# Two float32 programs that sum in different orders (XLA's fusions, cuBLAS, the kernels) may pick
# different greedy tokens where the two best logits are this close, relative to the largest logit.
NEAR_TIE = 1e-4


def assert_greedy_matches_full_forward(got, reference, prompts, steps, full=None):
  """got equals the full forward's greedy tokens, except that a row may part from them at a near-tie:
  where it first differs, the two tokens' full-forward logits are within NEAR_TIE of each other. On the
  CPU the tokens are equal; on a GPU, a random tiny float32 model has such ties. full: the result of
  greedy_by_full_forward(reference, prompts, steps, with_logits=True) where the caller has it."""
  want, logits = full or greedy_by_full_forward(reference, prompts, steps, with_logits=True)
  got = np.asarray(got)
  for r in range(len(prompts)):
    differ = np.flatnonzero(got[r] != want[r])
    if differ.size == 0:
      continue
    j = differ[0]
    scale = np.max(np.abs(logits[r, j]))
    gap = logits[r, j, want[r, j]] - logits[r, j, got[r, j]]
    assert gap <= NEAR_TIE * scale, (f"row {r} parts from the full forward at step {j} ({got[r]} vs {want[r]}) "
                                     f"where its logits differ by {gap:.3g} (largest {scale:.3g}): not a near-tie")
    assert jax.default_backend() != "cpu", f"row {r}: tokens {got[r]} vs {want[r]} on the CPU"


def decode_logits_error(model, reference, prompts, steps, full=None) -> float:
  """Teacher-forced: the decode step's logits against the full forward's at every step, both fed the
  full forward's greedy tokens; max |difference| / max |logit|. full: as for
  assert_greedy_matches_full_forward."""
  want, full = full or greedy_by_full_forward(reference, prompts, steps, with_logits=True)
  tokens, lengths = left_pad(prompts)
  graphdef, params = nnx.split(model)
  decoding = nnx.merge(graphdef, params)
  decoding.init_cache(len(prompts), tokens.shape[1] + steps, start=tokens.shape[1] - np.asarray(lengths))
  step = nnx.jit(lambda m, t: m(t, decode=True)[0])
  got = [np.asarray(step(decoding, jnp.asarray(tokens)))[:, -1]]
  for j in range(steps - 1):
    got.append(np.asarray(step(decoding, jnp.asarray(want[:, j:j + 1])))[:, 0])
  got = np.stack(got, 1)
  return float(np.max(np.abs(got - full)) / np.max(np.abs(full)))


@pytest.mark.parametrize("variant", ["dense", "moe", "moe_int8"])
def test_greedy_cached_decoding_equals_full_forward(variant):
  model = _model(0 if variant == "dense" else 1)
  reference = model
  if variant == "moe_int8":
    model = quantize_model(model)
    reference = dequantize_model(model)  # the full forward of the very weights the int8 model holds
  steps = 9
  got = np.asarray(generate(model, PROMPTS, steps, temperature=0.0))
  assert_greedy_matches_full_forward(got, reference, PROMPTS, steps)
  assert len({tuple(r) for r in got}) > 1  # the rows really differ: padding did not leak across rows
  assert not jax.tree.leaves(nnx.state(model, nnx.Cache))  # the caller's model gets no cache


@pytest.mark.parametrize("variant", ["moe", "moe_int8"])
def test_greedy_decoding_above_a_row_group_equals_full_forward(monkeypatch, variant):
  """At 18 rows (above decode_moe.ROW_GROUP) each expert takes its own tokens in groups of 16 rows: four experts,
  top-2, so an expert holds more than 16 tokens (two groups) in most steps."""
  from sparsejax.inference import decode_moe
  groups = []
  real = decode_moe._grouped_rows_ffn
  monkeypatch.setattr(decode_moe, "_grouped_rows_ffn", lambda *a: groups.append(1) or real(*a))
  model = reference = _model(1)
  if variant == "moe_int8":
    model = quantize_model(model)
    reference = dequantize_model(model)
  rng = np.random.default_rng(6)
  prompts = [list(rng.integers(1, 256, int(rng.integers(1, 8)))) for _ in range(18)]
  steps = 4
  got = np.asarray(generate(model, prompts, steps, temperature=0.0))
  assert groups, "the grouped form did not run"
  assert_greedy_matches_full_forward(got, reference, prompts, steps)


def test_greedy_decoding_with_the_router_kernel_equals_full_forward(monkeypatch):
  """The decode step's one-kernel router (forced here, in interpret mode; "auto" takes it on a GPU)
  routes as the full forward's XLA router does: the same greedy tokens."""
  from sparsejax import modules
  from sparsejax.kernels.decode_router import decode_router, runs_kernel
  traced = []

  def forced(*args, **kwargs):
    traced.append(args[0].shape)
    return decode_router(*args, **kwargs, impl="triton")

  monkeypatch.setattr(modules, "runs_kernel", lambda *shape: runs_kernel(*shape, impl="triton"))
  monkeypatch.setattr(modules, "decode_router", forced)
  model = _model(1)
  got = np.asarray(generate(model, PROMPTS, 6, temperature=0.0))
  assert (len(PROMPTS), BASE.d_model) in traced  # the one-token decode step took the kernel
  assert_greedy_matches_full_forward(got, model, PROMPTS, 6)


def force_decode_kernels(monkeypatch) -> list:
  """Makes every decode-step op take its Pallas kernel (interpret mode here; "auto" takes them on a GPU)
  and returns a list that records, per traced skinny_matmul kernel, what its rows were (Plain, Normed,
  Hidden) and "qkv" per decode_qkv kernel."""
  from sparsejax import modules
  from sparsejax.kernels.decode_qkv import op as qkv_op
  from sparsejax.kernels.decode_qkv import triton as qkv_triton
  from sparsejax.kernels.decode_router import decode_router, runs_kernel
  from sparsejax.kernels.skinny_matmul import op as sm_op
  from sparsejax.kernels.skinny_matmul import triton as sm_triton
  from sparsejax.models import transformer
  seen = []
  real_runs, real_parts, real_qkv = sm_op.runs_kernel, sm_triton.skinny_matmul_parts, qkv_triton.decode_qkv

  def parts(operands, source, *args, **kwargs):
    seen.append(type(source).__name__)
    return real_parts(operands, source, *args, **kwargs)

  def qkv(*args, **kwargs):
    seen.append("qkv")
    return real_qkv(*args, **kwargs)

  monkeypatch.setattr(sm_op, "runs_kernel", lambda m, k, n, impl="auto": real_runs(m, k, n, "triton"))
  monkeypatch.setattr(sm_triton, "skinny_matmul_parts", parts)
  monkeypatch.setattr(qkv_triton, "decode_qkv", qkv)
  monkeypatch.setattr(qkv_op, "runs_kernel", lambda dh, impl="auto": True)
  monkeypatch.setattr(transformer, "qkv_runs_kernel", lambda dh: True)
  monkeypatch.setattr(modules, "runs_kernel", lambda *shape: runs_kernel(*shape, impl="triton"))
  monkeypatch.setattr(modules, "decode_router", lambda *a, **kw: decode_router(*a, **kw, impl="triton"))
  return seen


@pytest.mark.parametrize("variant", ["dense", "dense_glu", "moe", "moe_glu", "moe_int8"])
def test_greedy_decoding_with_every_decode_kernel(monkeypatch, variant):
  """The decode step with every kernel forced: each layer's RMSNorms inside its first products (qkv, the
  router, the first expert or MLP products), the qkv parts' sum, RoPE and cache writes in decode_qkv,
  and the hidden layer inside W_out's kernel. It decodes the full forward's greedy tokens."""
  seen = force_decode_kernels(monkeypatch)
  model = reference = Transformer(BASE.replace(moe_every=0 if variant.startswith("dense") else 1,
                                               glu=variant.endswith("glu")), rngs=nnx.Rngs(0))
  if variant == "moe_int8":  # the int8 experts enter the same kernels, with their scales
    model = quantize_model(model)
    reference = dequantize_model(model)
  got = np.asarray(generate(model, PROMPTS, 5, temperature=0.0))
  # per layer of each traced one-token step: decode_qkv once, the qkv and first FFN products take the
  # norm, the attention output is plain rows, W_out takes the hidden layer (the prefill adds more)
  steps, rest = divmod(seen.count("qkv"), BASE.num_layers)
  assert steps >= 1 and rest == 0
  assert seen.count("Hidden") >= steps * BASE.num_layers and seen.count("Plain") >= steps * BASE.num_layers
  assert seen.count("Normed") >= (3 if variant.endswith("glu") else 2) * steps * BASE.num_layers
  # One full forward (its tokens and logits) serves both checks.
  full = greedy_by_full_forward(reference, PROMPTS, 5, with_logits=True)
  assert_greedy_matches_full_forward(got, reference, PROMPTS, 5, full)
  # the step's logits, fed the full forward's tokens, are the full forward's to float32 rounding
  assert decode_logits_error(model, reference, PROMPTS, 5, full) < 1e-5


@pytest.mark.parametrize("variant", ["dense", "moe", "moe_routed", "moe_routed_added_by_xla", "moe_selected_by_router"])
def test_greedy_decoding_at_batch_one_with_the_row_ffn_and_its_residual_kernel(monkeypatch, variant):
  """One prompt, every decode kernel forced and the feed-forward's one-kernel row form taken at these small
  sizes: each layer's step runs the row kernel, then one kernel that sums its parts, combines the slots and adds
  the residual (skinny_ffn_residual). moe_routed: W_r split over two programs, so the router runs its logits
  kernel alone, adding the attention's W_o parts to the residual stream itself (MoE's pending), and the row
  kernel selects from its parts (decode_moe.routed_decode_layer); moe_routed_added_by_xla: the same with XLA's
  add (PENDING_RESIDUAL off); moe_selected_by_router: the router's kernel adds, its select kernel selects
  (SELECTS_IN_EXPERTS off). It decodes the full forward's greedy tokens and logits."""
  generate_module = importlib.import_module("sparsejax.inference.generate")  # the package exports generate()
  from sparsejax import modules
  from sparsejax.inference import decode_moe
  from sparsejax.kernels.decode_router import splits_logits
  from sparsejax.kernels.decode_router import triton as router_triton
  from sparsejax.kernels.skinny_matmul import triton_row_ffn
  force_decode_kernels(monkeypatch)
  monkeypatch.setattr(triton_row_ffn, "MIN_PROGRAMS", 1)
  routed = variant.startswith("moe_routed")
  pendings, real_parts = [], modules.router_logit_parts
  if variant.startswith("moe_"):  # [16, 4] tiles: d_model 32 is two of them, one a program
    monkeypatch.setattr(router_triton, "TILE_NUMBERS", 64)
    monkeypatch.setattr(decode_moe, "splits_logits", lambda *shape: splits_logits(*shape, impl="triton"))
    monkeypatch.setattr(decode_moe, "PENDING_RESIDUAL", variant != "moe_routed_added_by_xla")
    monkeypatch.setattr(decode_moe, "SELECTS_IN_EXPERTS", routed)
    # the flags act where the step is traced: no step compiled under other flags may be reused
    generate_module._compiled_step.cache_clear()
    generate_module._compiled_loop.cache_clear()

    def recording_parts(*args, pending=None, **kwargs):
      pendings.append(None if pending is None else pending.shape)
      return real_parts(*args, pending=pending, **kwargs)

    monkeypatch.setattr(modules, "router_logit_parts", recording_parts)
  real, epilogues = triton_row_ffn.residual_epilogue, []
  real_row, routes = triton_row_ffn.row_ffn_parts, []

  def recording(parts, *args, **kwargs):
    epilogues.append(parts.shape)
    return real(parts, *args, **kwargs)

  def recording_row(*args, **kwargs):
    routes.append(args[10] if len(args) > 10 else kwargs.get("routed"))
    return real_row(*args, **kwargs)

  monkeypatch.setattr(triton_row_ffn, "residual_epilogue", recording)
  monkeypatch.setattr(triton_row_ffn, "row_ffn_parts", recording_row)
  # d_ff 128, 256 or 512 (8, 16 or 32 float32 slabs): a config of its own, so no other test's compiled step is
  # reused here
  d_ff = {"moe_routed": 256, "moe_routed_added_by_xla": 512}.get(variant, 128)
  model = Transformer(BASE.replace(moe_every=0 if variant == "dense" else 1, d_ff=d_ff), rngs=nnx.Rngs(3))
  prompt = PROMPTS[:1]
  got = np.asarray(generate(model, prompt, 5, temperature=0.0))
  slots = 1 if variant == "dense" else BASE.top_k
  assert epilogues and set(epilogues) == {(slots, d_ff // 16, BASE.d_model)}
  # the routed step's row kernel selects the top-k itself (and takes the weights: renormalize, as top_k > 1)
  assert set(routes) == ({triton_row_ffn.Routed(BASE.top_k, True)} if routed else {None})
  # the pending W_o product: K 32 is one split-K part of one row (the router's tests sum several)
  assert set(pendings) == ({(1, 1, BASE.d_model)} if variant in ("moe_routed", "moe_selected_by_router") else set())
  assert len(epilogues) % BASE.num_layers == 0
  full = greedy_by_full_forward(model, prompt, 5, with_logits=True)
  assert_greedy_matches_full_forward(got, model, prompt, 5, full)
  assert decode_logits_error(model, model, prompt, 5, full) < 1e-5


def test_greedy_decoding_at_a_width_not_a_power_of_two(monkeypatch):
  """d_model 96 (as 768 is, not a power of two): the norms still fold into the qkv and router products, whose
  programs load the row as a masked block of 128, and the router's kernel adds W_o's pending parts and stores the
  row it made; the experts' row kernel takes d as pieces of 64 and 32 (its norm folded in), routes itself, and its
  epilogue sums d_ff 96's six slabs as pieces of 4 and 2. One prompt, every decode kernel forced; it decodes the
  full forward's greedy tokens."""
  generate_module = importlib.import_module("sparsejax.inference.generate")
  from sparsejax import modules
  from sparsejax.inference import decode_moe
  from sparsejax.kernels.decode_router import splits_logits
  from sparsejax.kernels.decode_router import triton as router_triton
  from sparsejax.kernels.skinny_matmul import triton_row_ffn
  seen = force_decode_kernels(monkeypatch)
  monkeypatch.setattr(triton_row_ffn, "MIN_PROGRAMS", 1)
  monkeypatch.setattr(router_triton, "TILE_NUMBERS", 64)  # [16, 4] tiles: 96 is six, three a program
  monkeypatch.setattr(decode_moe, "splits_logits", lambda *shape: splits_logits(*shape, impl="triton"))
  generate_module._compiled_step.cache_clear()
  generate_module._compiled_loop.cache_clear()
  pendings, real_parts = [], modules.router_logit_parts

  def recording_parts(*args, pending=None, **kwargs):
    pendings.append(None if pending is None else pending.shape)
    return real_parts(*args, pending=pending, **kwargs)

  monkeypatch.setattr(modules, "router_logit_parts", recording_parts)
  real_row, real_epilogue, rows, epilogues = triton_row_ffn.row_ffn_parts, triton_row_ffn.residual_epilogue, [], []

  def recording_row(x_operands, source, *args, **kwargs):
    rows.append((type(source).__name__, args[8] if len(args) > 8 else kwargs.get("routed")))
    return real_row(x_operands, source, *args, **kwargs)

  def recording_epilogue(parts, *args, **kwargs):
    epilogues.append(parts.shape)
    return real_epilogue(parts, *args, **kwargs)

  monkeypatch.setattr(triton_row_ffn, "row_ffn_parts", recording_row)
  monkeypatch.setattr(triton_row_ffn, "residual_epilogue", recording_epilogue)
  config = BASE.replace(d_model=96, num_heads=3, moe_every=1, d_ff=96)
  model = Transformer(config, rngs=nnx.Rngs(5))
  prompt = PROMPTS[:1]
  got = np.asarray(generate(model, prompt, 5, temperature=0.0))
  steps = seen.count("qkv") // config.num_layers
  assert steps >= 1 and seen.count("Normed") >= steps * config.num_layers
  assert pendings and set(pendings) == {(1, 1, 96)}
  assert set(rows) == {("Normed", triton_row_ffn.Routed(config.top_k, True))}
  assert set(epilogues) == {(config.top_k, 96 // 16, 96)}  # float32: 16-column slabs
  full = greedy_by_full_forward(model, prompt, 5, with_logits=True)
  assert_greedy_matches_full_forward(got, model, prompt, 5, full)
  assert decode_logits_error(model, model, prompt, 5, full) < 1e-5


@pytest.mark.parametrize("moe_every,temperature,chunk", [(0, 0.0, 3), (1, 0.8, 8)])
def test_device_loop_equals_single_steps(moe_every, temperature, chunk):
  """Decoder.run (n steps in one jitted loop) samples exactly the tokens, and leaves the routing counts
  and the cache, of n single steps: same keys fold_in(rng, step), n = 1, n not a multiple of the chunk,
  n larger than it, and a single step after the loop."""
  model = _model(moe_every)
  sampling = Sampling(temperature, top_k=None if temperature == 0 else 20)
  tokens, lengths = left_pad(PROMPTS)
  make = lambda c: Decoder(model, len(PROMPTS), tokens.shape[1] + 16, sampling, jax.random.key(7),
                           start=tokens.shape[1] - lengths, chunk=c)
  ref, loop = make(8), make(chunk)
  want = [ref(jnp.asarray(tokens))]
  got = [loop(jnp.asarray(tokens))]
  for n in (1, 5, 9):
    for _ in range(n):
      want.append(ref(want[-1][:, None]))
    got.extend(loop.run(got[-1], n).T)
    np.testing.assert_array_equal(np.stack(got, 1), np.stack(want, 1))
    np.testing.assert_array_equal(loop.tokens_per_expert, ref.tokens_per_expert)
  assert loop._loop._cache_size() == 1  # one compile for every n
  np.testing.assert_array_equal(loop(got[-1][:, None]), ref(want[-1][:, None]))  # the cache index is right
  assert loop.position == ref.position == tokens.shape[1] + 16 and loop.steps == ref.steps == 17
  if moe_every:
    assert np.asarray(loop.tokens_per_expert).sum() > 0
  with pytest.raises(ValueError, match=r"no room for 1 more token\."):
    loop.run(got[-1], 1)
  fresh = make(chunk)
  for bad, err in [(dict(n=0), "n must be an int >= 1"), (dict(n=2.0), "n must be an int >= 1"),
                   (dict(tokens=jnp.zeros((3, 1), jnp.int32)), r"shape \(3,\); got shape \(3, 1\)"),
                   (dict(n=tokens.shape[1] + 17), "no room for 24 more tokens")]:
    with pytest.raises(ValueError, match=err):
      fresh.run(**{"tokens": jnp.zeros((3,), jnp.int32), "n": 2, **bad})
  with pytest.raises(ValueError, match="chunk must be an int >= 1"):
    make(0)


def test_quantized_model_halves_expert_bytes_and_keeps_logits_close():
  model = _model(1)
  q = quantize_model(model)
  e, d, f, layers = BASE.num_experts, BASE.d_model, BASE.d_ff, 2
  scales = 4 * layers * e * (f + d)  # one float32 per output column of w_in and of w_out
  assert expert_bytes(model) == 4 * layers * 2 * e * d * f
  assert expert_bytes(q) == expert_bytes(model) // 4 + scales  # float32 -> int8
  tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]])
  fwd = nnx.jit(lambda m, t: m(t)[0])
  a, b = fwd(model, tokens), fwd(q, tokens)
  assert float(jnp.max(jnp.abs(a - b))) < 0.05 * float(jnp.max(jnp.abs(a)))
  with pytest.raises(ValueError, match="already quantized"):
    quantize_model(q)
  with pytest.raises(ValueError, match="no MoE layer"):
    quantize_model(_model(0))


def test_sampling_respects_top_k_top_p_and_the_key():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
  key = jax.random.key(0)
  draw = jax.jit(sample_logits, static_argnames="sampling")
  counts = lambda s: np.bincount(np.asarray(draw(logits, key, sampling=s)), minlength=4)
  c = counts(Sampling(1.0))
  np.testing.assert_allclose(c / c.sum(), [0.5, 0.3, 0.15, 0.05], atol=0.03)
  assert counts(Sampling(1.0, top_k=2))[2:].sum() == 0
  assert counts(Sampling(1.0, top_p=0.7))[2:].sum() == 0  # 0.5 < 0.7 <= 0.8: the top two
  assert counts(Sampling(1.0, top_p=0.81))[3] == 0
  np.testing.assert_array_equal(counts(Sampling(0.0)), [4000, 0, 0, 0])
  model = _model(0)
  run = lambda seed: np.asarray(generate(model, PROMPTS, 6, temperature=1.0, top_k=20,
                                         rng=jax.random.key(seed)))
  a, b, c = run(1), run(1), run(2)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert a.min() >= 0 and a.max() < 256


def test_timings_and_shapes():
  g = generate_timed(_model(0), PROMPTS, 9, temperature=0.0)  # the shapes (and compiles) of the tests above
  assert g.tokens.shape == (3, 9) and g.prompt_lengths == (7, 1, 4)
  assert g.prefill_s > 0 and g.decode_s > 0 and g.decode_tokens_per_s > 0
  assert np.asarray(generate(_model(0), [1, 2, 3], 1, temperature=0.0)).shape == (1, 1)


def test_quantize_and_dequantize_model_name_the_dict_function():
  """A params dict once passed through dequantize_model unchanged (still int8)."""
  params = {"blocks": {"0": {"ffn": {"w_in": jnp.ones((2, 4, 8))}}}}
  for fn in (quantize_model, dequantize_model):
    with pytest.raises(TypeError, match="expected an nnx model .*got dict.*quantize_experts"):
      fn(params)


def test_bad_arguments_fail_before_compiling():
  model = _model(0)
  call = lambda prompts=PROMPTS, n=4, **kw: generate(model, prompts, n, **{"temperature": 0.0, **kw})
  cases = [
      (dict(n=0), ValueError, "max_new_tokens must be an int >= 1"),
      (dict(n=2.0), ValueError, "max_new_tokens must be an int >= 1"),
      (dict(temperature=-1.0), ValueError, "temperature must be a finite number >= 0"),
      (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0"),
      (dict(top_p=0.0), ValueError, r"top_p must lie in \(0, 1\]"),
      (dict(top_p=1.5), ValueError, r"top_p must lie in \(0, 1\]"),
      (dict(top_k=0), ValueError, "top_k must be an int >= 1"),
      (dict(temperature=0.7), ValueError, "needs rng"),
      (dict(temperature=0.7, rng=3), TypeError, "rng must be a jax key"),
      (dict(n=60), ValueError, "more than the model's max_seq_len=48"),
      (dict(prompts=[[1]], n=60), ValueError, r"the longest prompt \(1 token\) plus max_new_tokens=60"),
      (dict(cache_length=8), ValueError, "needs 10 cache slots; cache_length is 8"),
      (dict(prompts=[[1, 2], []]), ValueError, "prompt 1 must be a non-empty"),
      (dict(prompts=[]), ValueError, "prompt_tokens is empty"),
      (dict(prompts=[[1, 256]]), ValueError, r"must lie in \[0, vocab_size=256\)"),
      (dict(prompts=[[1.5, 2.0]]), TypeError, "integer token ids"),
      (dict(prompts=np.zeros((2, 2, 2), np.int32)), ValueError, r"\[batch, length\]"),
  ]
  for kw, err, msg in cases:
    with pytest.raises(err, match=msg):
      call(**kw)
  with pytest.raises(TypeError, match="init_cache"):
    generate(object(), PROMPTS, 2, temperature=0.0)
  with pytest.raises(ValueError, match="call model.init_cache"):
    model(jnp.zeros((1, 2), jnp.int32), decode=True)
  with pytest.raises(ValueError, match="cache length 100"):
    model.init_cache(1, 100)


# ------------------------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  """A tiny MoE run trained for a few steps, with its corpus."""
  from sparsejax.train import TrainConfig, train
  tmp = tmp_path_factory.mktemp("run")
  corpus = tmp / "corpus"
  corpus.mkdir()
  rng = np.random.default_rng(0)
  words = ["def", "return", "self", "import", "class", "moe", "expert", "router"]
  for i in range(8):
    (corpus / f"doc{i}.py").write_text(" ".join(rng.choice(words, 300)))
  cfg = TrainConfig(preset="tiny-moe", data=str(corpus), out=str(tmp / "run"), steps=6, batch_size=4,
                    seq_len=32, lr=1e-2, warmup=2, eval_every=0, eval_batches=2, ckpt_every=6, log_every=6,
                    progress=False, model_overrides=dict(d_model=32, num_layers=2, num_heads=2, d_ff=64,
                                                         num_experts=4, max_seq_len=64))
  final = train(cfg)
  return tmp / "run", str(corpus), final


def test_cli_generates_from_a_trained_run(trained_run, capsys):
  from sparsejax.inference import cli
  run, _, _ = trained_run
  cli.main(["--run", str(run), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"])
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith("def ") and len(out[0].encode()) >= 4
  assert "tokens/s" in out[-1] and "step 6" in out[-1]
  # Greedy from the CLI is the greedy continuation of the restored model.
  model, _ = cli.load_model(str(run))
  want = np.asarray(generate(model, [list(b"def ")], 12, temperature=0.0))[0]
  text = "\n".join(out[:-1])
  assert text == "def " + bytes(want.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
  cli.main(["--run", str(run), "--prompt", "x", "--max-new-tokens", "3", "--int8", "--num-samples", "2",
            "--top-p", "0.9"])
  out = capsys.readouterr().out
  assert out.count("--- sample") == 2 and "tokens/s" in out


def test_cli_help_states_every_default_in_words():
  from sparsejax.inference import cli
  for action in cli.build_parser()._actions:
    if action.option_strings != ["-h", "--help"]:
      assert ("(default: " in action.help) != action.required, action.option_strings
      assert "None" not in action.help, action.option_strings


@pytest.mark.parametrize("args,msg,code", [
    (["--run", "{missing}"], "no run folder at", 1),
    (["--run", "{empty}"], "no checkpoint in", 1),
    (["--run", "{run}", "--step", "7"], "no checkpoint of step 7", 1),
    (["--run", "{run}", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1", 2),
    (["--run", "{run}", "--top-p", "1.5"], r"--top-p must lie in (0, 1]", 2),
    (["--run", "{run}", "--max-new-tokens", "500"], "more than the model's max_seq_len=64", 1),
    (["--prompt", "x"], "the following arguments are required: --run", 2),
])
def test_cli_errors_are_one_line(trained_run, tmp_path, capsys, args, msg, code):
  from sparsejax.inference import cli
  run, _, _ = trained_run
  (tmp_path / "empty").mkdir()
  args = [a.format(missing=tmp_path / "nope", empty=tmp_path / "empty", run=run) for a in args]
  with pytest.raises(SystemExit) as e:
    cli.main(args)
  assert e.value.code == code
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and err.startswith("sparsejax-generate: error:") and msg in err, err


def test_int8_experts_keep_the_validation_loss(trained_run):
  """Validation loss of the trained tiny MoE before and after int8 experts (printed for the report)."""
  from sparsejax.data import eval_batches, load_corpus
  from sparsejax.inference import cli
  from sparsejax.models import cross_entropy
  run, corpus, final = trained_run
  model, _ = cli.load_model(str(run))
  val = eval_batches(load_corpus(corpus).val, 4, 32, 2)
  loss = nnx.jit(lambda m, x, y: cross_entropy(m(x)[0], y))
  before = float(np.mean([loss(model, x, y) for x, y in val]))
  after = float(np.mean([loss(quantize_model(model), x, y) for x, y in val]))
  print(f"val loss float32 {before:.4f}, int8 experts {after:.4f}")
  np.testing.assert_allclose(before, final["val_loss"], rtol=1e-5)  # the restored model is the trained one
  assert abs(after - before) < 0.01 * before
