"""The compute-dtype copy of the weights (make_steps(with_copy=True)): the forward reads the bf16
copy AdamW writes instead of casting the float32 params, with the old step's numbers bit for bit;
the copy is what cast_dtypes says the forward casts, stays cast(params), never reaches a checkpoint,
and lies on a mesh as its params do."""
import functools
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsejax.checkpoint import Checkpointer
from sparsejax.models import Transformer, get_preset
from sparsejax.train import (TrainConfig, cast_dtypes, compute_copy, expert_parallel_state, functional,
                             make_optimizer, make_steps, train)
from corpus_testing import write_corpus

TINY = dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, num_experts=4, max_seq_len=32, glu=True)
BF16 = dict(TINY, dtype="bfloat16", param_dtype="float32")
is_none = lambda v: v is None


def _model(**overrides):
  return functional(Transformer(get_preset("tiny-moe", **overrides), rngs=nnx.Rngs(0)))


@functools.lru_cache(maxsize=None)
def _old_and_new_steps(dtype: str):
  """The tiny model ("bf16" or "float32"), its optimizer, and the step without the copy and with it: shared by the
  tests of one dtype, so that each step compiles once for its shapes (a compile is most of such a test's time)."""
  apply, params = _model(**(BF16 if dtype == "bf16" else TINY))
  tx = make_optimizer(TrainConfig(lr=1e-2, warmup=1, steps=30))
  return apply, params, tx, make_steps(apply, tx, seed=0)[0], make_steps(apply, tx, seed=0, with_copy=True)[0]


def _tokens(steps, seed=0, batch=4):
  return jax.random.randint(jax.random.key(seed), (steps, batch, 33), 0, 256)


def _copied(dtypes) -> dict:
  """{path: dtype name} of the leaves cast_dtypes copies."""
  flat = jax.tree_util.tree_leaves_with_path(dtypes, is_leaf=is_none)
  return {jax.tree_util.keystr(p): jnp.dtype(d).name for p, d in flat if d is not None}


def _bitwise_equal(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _same_step(a, b) -> bool:
  """Bit for bit on the CPU. On a GPU the two steps are two compiled programs, and XLA may pick another GEMM
  algorithm for a product in each (an H100 run of the float32 case differed after step 0), so there they agree to
  float32 rounding."""
  if jax.default_backend() == "cpu":
    return _bitwise_equal(a, b)
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      x.dtype == y.dtype and np.allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-5, atol=1e-7)
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_the_copy_is_the_weights_the_forward_casts_first_thing():
  """bf16 over float32: attention, FFN, expert and head weights get a bf16 copy; the router (a float32
  matmul), the embedding (gathered, then cast) and the norm scales none. A float32 model: no copy."""
  apply, params = _model(**BF16)
  x = _tokens(1)[0, :, :-1]
  got = _copied(cast_dtypes(apply, params, x, rng=jax.random.key(0)))
  weights = {f"['blocks'][{i}]['{m}']['{w}']" for i in (0, 1)
             for m, w in (("attn", "w_qkv"), ("attn", "w_out"), ("ffn", "w_in"), ("ffn", "w_gate"), ("ffn", "w_out"))}
  assert got == {k: "bfloat16" for k in weights | {"['head']"}}
  for remat in ("hidden", "ffn", "block"):  # the casts inside rematerialized regions are found as well
    apply_r, params_r = _model(**BF16, remat=remat)
    assert _copied(cast_dtypes(apply_r, params_r, x, rng=jax.random.key(0))) == got, remat
  apply32, params32 = _model(**TINY)
  assert _copied(cast_dtypes(apply32, params32, x, rng=jax.random.key(0))) == {}
  assert jax.tree.leaves(compute_copy(params32, cast_dtypes(apply32, params32, x))) == []


def test_a_weight_used_other_than_by_one_cast_gets_no_copy():
  """A copy stands in for p.astype(d) only: two casts would sum their gradients in bf16, not float32."""
  def apply(p, x):
    once = x @ p["once"].astype(jnp.bfloat16)
    twice = x @ p["twice"].astype(jnp.bfloat16) + x @ p["twice"].astype(jnp.bfloat16)
    return once + twice + x @ p["mixed"].astype(jnp.bfloat16) + (x @ p["mixed"]).astype(jnp.bfloat16), p["returned"]

  params = {k: jnp.ones((4, 4)) for k in ("once", "twice", "mixed", "returned")}
  got = _copied(cast_dtypes(apply, params, jnp.ones((2, 4), jnp.bfloat16)))
  assert got == {"['once']": "bfloat16"}
  # Inside a rematerialized region the same rules hold; a weight that also has a use outside it gets no copy.
  remat = jax.checkpoint(lambda p, x: (apply(p, x), x @ p["outside"].astype(jnp.bfloat16)))
  params["outside"] = jnp.ones((4, 4))
  got = _copied(cast_dtypes(lambda p, x: (remat(p, x), x @ p["outside"].astype(jnp.bfloat16)), params,
                            jnp.ones((2, 4), jnp.bfloat16)))
  assert got == {"['once']": "bfloat16"}


@pytest.mark.parametrize("overrides", [BF16, TINY], ids=["bf16", "float32"])
def test_steps_with_the_copy_match_the_old_step_bit_for_bit(overrides):
  """Four steps: params, optimizer state and every metric equal the old step's exactly, and after
  each step the copy is cast(params)."""
  apply, params, tx, old, new = _old_and_new_steps("bf16" if overrides is BF16 else "float32")
  tok = _tokens(4)
  dtypes = cast_dtypes(apply, params, tok[0, :, :-1], rng=jax.random.key(0))
  a = jax.tree.map(jnp.copy, (params, tx.init(params)))  # the steps donate their state
  b = jax.tree.map(jnp.copy, (params, tx.init(params)))
  copy = compute_copy(b[0], dtypes)
  for i in range(4):
    x, y = tok[i, :, :-1], tok[i, :, 1:]
    *a, ma = old(*a, x, y, jnp.int32(i))
    *b, mb, copy = new(*b, x, y, jnp.int32(i), copy)
    assert _same_step(a, b) and _same_step(ma, mb), i
    assert _bitwise_equal(copy, compute_copy(b[0], dtypes)), i
  assert len(jax.tree.leaves(copy)) == (11 if overrides is BF16 else 0)


def _entry_casts(hlo: str) -> list[str]:
  """Entry instructions of the optimized HLO that make a bf16 array out of one float32 params leaf alone."""
  return re.findall(r"= bf16\[[\d,]*\]\S* (?:fusion|convert)\((%params__[^,)]*)\)", hlo)


def test_the_compiled_step_casts_no_param_in_its_forward():
  """XLA:CPU's optimized HLO: the old step converts each float32 weight to bf16 on entry; the step
  with the copy converts none (its casts read the updated params, at the end of the step)."""
  apply, params, tx, old, new = _old_and_new_steps("bf16")
  opt_state = tx.init(params)
  x, y = _tokens(1)[0, :, :-1], _tokens(1)[0, :, 1:]
  copy = compute_copy(params, cast_dtypes(apply, params, x, rng=jax.random.key(0)))
  before = _entry_casts(old.lower(params, opt_state, x, y, jnp.int32(0)).compile().as_text())
  after = _entry_casts(new.lower(params, opt_state, x, y, jnp.int32(0), copy).compile().as_text())
  assert any("w_in" in p for p in before) and any("head" in p for p in before), before  # what goes
  assert after == []


def test_a_restored_checkpoint_rebuilds_the_copy_and_resumes_exactly(tmp_path):
  """Save params and optimizer after a step, restore, rebuild the copy from the restored params: the
  next step equals the live run's bit for bit, its copy included."""
  apply, params = _model(**BF16)
  tx = make_optimizer(TrainConfig(steps=10, warmup=2))
  tok = _tokens(3)
  step, _ = make_steps(apply, tx, seed=0, with_copy=True)
  dtypes = cast_dtypes(apply, params, tok[0, :, :-1], rng=jax.random.key(0))
  # Committed to a device, as restored arrays are, so that the step compiles once for all its calls.
  params, opt_state = jax.device_put((params, tx.init(params)), jax.devices()[0])
  copy = compute_copy(params, dtypes)
  for i in range(2):  # the warm-up's first update has lr 0: the second moves the weights
    params, opt_state, _, copy = step(params, opt_state, tok[i, :, :-1], tok[i, :, 1:], jnp.int32(i), copy)
  Checkpointer(tmp_path, every=1).save(1, {"params": params, "opt_state": opt_state}, {"step": 1})
  template = jax.tree.map(jnp.zeros_like, {"params": params, "opt_state": opt_state})
  items, _ = Checkpointer(tmp_path).restore(template)
  restored_copy = compute_copy(items["params"], dtypes)
  assert _bitwise_equal(restored_copy, copy)
  x, y = tok[2, :, :-1], tok[2, :, 1:]
  resumed = step(items["params"], items["opt_state"], x, y, jnp.int32(2), restored_copy)
  live = step(params, opt_state, x, y, jnp.int32(2), copy)
  assert _bitwise_equal(resumed, live)


def test_a_bf16_run_resumes_on_the_curve_of_a_run_without_the_copy(tmp_path, monkeypatch):
  """train() in bf16 reads the copy; its losses equal those of the same run with the copy turned off
  (cast_dtypes copying nothing), and a run killed after step 2's checkpoint resumes on that curve."""
  from sparsejax import train as loop
  data = write_corpus(tmp_path, docs=12, words_per_doc=400)
  cfg = lambda out, **kw: TrainConfig(**{**dict(
      preset="tiny-moe", data=data, out=str(tmp_path / out), steps=4, batch_size=4, seq_len=32, warmup=1,
      eval_every=0, eval_batches=1, ckpt_every=2, keep=2, log_every=1, progress=False, model_overrides=BF16), **kw})
  losses = lambda out: {r["step"]: r["loss"] for r in map(__import__("json").loads,
                                                           (tmp_path / out / "metrics.jsonl").read_text().splitlines())
                        if r["kind"] == "train"}
  seen = []
  real = loop.cast_dtypes
  monkeypatch.setattr(loop, "cast_dtypes", lambda *a, **kw: seen.append(_copied(real(*a, **kw))) or real(*a, **kw))
  train(cfg("copy"))
  assert len(seen[0]) == 11  # the run did read a copy
  # Its checkpoints hold what they held before: the float32 params and the optimizer state, no copy.
  items = {p.name for p in (tmp_path / "copy" / "checkpoints" / "2").iterdir() if p.is_dir()}
  assert items == {"meta", "params", "opt_state"}, items
  shutil.rmtree(tmp_path / "copy" / "checkpoints" / "4")
  (tmp_path / "copy" / "metrics.jsonl").rename(tmp_path / "copy_full.jsonl")
  train(cfg("copy"))  # resumes from step 2, rebuilding the copy from the restored params
  resumed = losses("copy")
  (tmp_path / "copy" / "metrics.jsonl").write_text((tmp_path / "copy_full.jsonl").read_text())
  full = losses("copy")
  assert sorted(resumed) == [3, 4] and all(resumed[s] == full[s] for s in (3, 4))
  monkeypatch.setattr(loop, "cast_dtypes", lambda *a, **kw: jax.tree.map(lambda d: None, real(*a, **kw)))
  train(cfg("no_copy", ckpt_every=0))
  assert losses("no_copy") == full


@pytest.mark.devices(8)
@pytest.mark.parametrize("spec", [(2, 4), (1, 8)])
def test_on_an_expert_mesh_the_copy_lies_as_its_params(spec):
  """Expert parallelism in bf16: the step with the copy equals the old one bit for bit, and every
  copied leaf, going in and coming out, has its float32 param's sharding (experts split)."""
  from sparsejax.mesh import make_expert_mesh
  from sparsejax.train import build_model
  cfg = TrainConfig(lr=1e-2, warmup=1, steps=30, seed=0)
  model_cfg = get_preset("tiny-moe", **{**BF16, "num_experts": 8, "num_layers": 1, "moe_every": 1})
  mesh = make_expert_mesh(*spec)
  model = build_model(cfg, model_cfg, mesh)
  apply, params = functional(model)
  tx = make_optimizer(cfg)
  tok = _tokens(2, seed=3, batch=8)  # a row per device
  batch = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "expert"))))
  runs = []
  for with_copy in (False, True):
    p, o, shardings = expert_parallel_state(model, jax.tree.map(jnp.copy, params), tx, mesh, 8)
    step, _ = make_steps(apply, tx, cfg.seed, shardings=shardings, with_copy=with_copy)
    copy = compute_copy(p, cast_dtypes(apply, p, tok[0, :, :-1], rng=jax.random.key(0))) if with_copy else None
    for i in range(2):
      args = (p, o, batch(tok[i, :, :-1]), batch(tok[i, :, 1:]), jnp.int32(i))
      if with_copy:
        p, o, m, copy = step(*args, copy)
      else:
        p, o, m = step(*args)
    runs.append((p, o, m, copy))
  (p0, o0, m0, _), (p1, o1, m1, copy) = runs
  assert _bitwise_equal((p0, o0, m0), (p1, o1, m1))
  assert _bitwise_equal(copy, compute_copy(p1, jax.tree.map(lambda c: c.dtype, copy)))
  w_in = copy["blocks"][0]["ffn"]["w_in"]
  assert w_in.sharding == p1["blocks"][0]["ffn"]["w_in"].sharding and w_in.sharding.spec[0] is not None
  pairs = jax.tree.leaves(jax.tree.map(lambda c, q: None if c is None else (c, q), copy, p1, is_leaf=is_none),
                          is_leaf=lambda v: isinstance(v, tuple))
  assert len(pairs) == 6 and all(c.sharding == q.sharding for c, q in pairs)
