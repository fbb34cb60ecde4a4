"""`--mesh data=D,[expert_group=G,]expert=X`: expert-parallel training on 8 host devices follows the one-device run's
losses, and the expert weights and their optimizer moments lie on the mesh as it says."""
import json
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sparsejax.cli import parse_args
from sparsejax.train import TrainConfig, prepare, run, train
from corpus_testing import write_corpus
from moe_testing import jaxpr_equations, loss_grads_and_kept_bytes

pytestmark = pytest.mark.devices(8)

# One block with E = 8 experts: expert=4 holds 2 per device, expert=8 one each (float32 on the CPU).
TINY = dict(d_model=32, num_layers=1, num_heads=2, d_ff=64, num_experts=8, moe_every=1, max_seq_len=16,
            dtype="float32")


def _corpus(tmp_path):
  return write_corpus(tmp_path)


def _cfg(tmp_path, name, **kw):
  base = dict(preset="tiny-moe", data=_corpus(tmp_path), out=str(tmp_path / name), steps=3, batch_size=8,
              seq_len=16, warmup=1, eval_every=0, eval_batches=1, ckpt_every=0, log_every=1, progress=False,
              model_overrides=TINY)
  return TrainConfig(**{**base, **kw})


def _losses(out):
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("one")
  final = train(_cfg(tmp, "run"))
  return _losses(tmp / "run"), final


@pytest.mark.parametrize("spec, shape", [("data=2,expert=4", {"data": 2, "expert": 4}),
                                         ("data=1,expert=8", {"data": 1, "expert": 8}),
                                         ("data=2,expert_group=2,expert=2", {"data": 2, "expert_group": 2, "expert": 2})])
def test_expert_parallel_training_follows_one_device(tmp_path, one_device, monkeypatch, spec, shape):
  """Same losses as one device; the compiled step gets w_in [E, d, f] split over "expert" (E/X per
  device), its Adam moments alike, the router and attention replicated; the MoE layers are traced
  through the expert-parallel layer, with the two-stage all-to-all when the mesh has expert groups."""
  from sparsejax import parallel
  from sparsejax import train as loop
  seen = {"ep_calls": 0, "hierarchical": set()}
  real, real_ep = loop.make_steps, parallel.expert_parallel_moe_mlp

  def ep_spy(*args, **kw):
    seen["ep_calls"] += 1
    seen["hierarchical"].add(kw["parallel"].hierarchical)
    return real_ep(*args, **kw)

  def spy(apply, tx, seed, *, shardings=None, **kw):
    seen["shardings"] = shardings
    return real(apply, tx, seed, shardings=shardings, **kw)

  monkeypatch.setattr(loop, "make_steps", spy)
  monkeypatch.setattr(parallel, "expert_parallel_moe_mlp", ep_spy)
  got = train(_cfg(tmp_path, "run", mesh=spec))
  losses, final = one_device
  np.testing.assert_allclose(_losses(tmp_path / "run"), losses, rtol=2e-5)
  np.testing.assert_allclose(got["val_loss"], final["val_loss"], rtol=2e-5)

  grouped = "expert_group" in shape
  assert seen["ep_calls"] >= 1 and seen["hierarchical"] == {grouped}  # the MoE layer went through it
  params, opt_state = seen["shardings"]
  w_in = params["blocks"][0]["ffn"]["w_in"]
  experts = ("expert_group", "expert") if grouped else "expert"
  assert dict(w_in.mesh.shape) == shape and w_in.spec == P(experts, None, None)
  assert w_in.shard_shape((8, 32, 64)) == (8 // (shape["expert"] * shape.get("expert_group", 1)), 32, 64)
  assert params["blocks"][0]["ffn"]["w_out"].spec == P(experts, None, None)
  assert params["blocks"][0]["ffn"]["router"]["w"].spec == P()
  assert params["blocks"][0]["attn"]["w_qkv"].spec == P()
  moments = [s for path, s in jax.tree_util.tree_leaves_with_path(opt_state)
             if jax.tree_util.keystr(path).endswith("['blocks'][0]['ffn']['w_in']")]
  assert len(moments) == 2 and all(m.spec == P(experts, None, None) for m in moments)  # Adam's mu, nu
  assert loop.batch_axes(w_in.mesh) == (tuple(shape),)


@pytest.mark.parametrize("remat", ["none", "ffn", "hidden"])
def test_exchange_buffers_of_the_mean_train_as_one_device(tmp_path, one_device, monkeypatch, remat):
  """--ep-buffer-factor 1 reaches the layers as ExpertParallelConfig.buffer_factor; steps whose routing overflows
  it take the exact fallback, so the losses are the one-device run's; also where the feed-forwards, exchange and
  fallback included, are recomputed in the backward (remat=ffn), or their hidden layers (remat=hidden). The log
  says, a step and MoE layer, how many assignments overflowed."""
  from sparsejax import parallel
  seen = set()
  real = parallel.expert_parallel_moe_mlp
  monkeypatch.setattr(parallel, "expert_parallel_moe_mlp",
                      lambda *a, **kw: seen.add(kw["parallel"].buffer_factor) or real(*a, **kw))
  train(_cfg(tmp_path, "run", mesh="data=1,expert=8", ep_buffer_factor=1.0, model_overrides={**TINY, "remat": remat}))
  assert seen == {1.0}
  np.testing.assert_allclose(_losses(tmp_path / "run"), one_device[0], rtol=2e-5)
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  overflow = [r["exchange_overflow"] for r in records if r["kind"] == "train"]
  assert len(overflow) == 3 and all(len(o) == 1 for o in overflow) and sum(map(sum, overflow)) > 0, overflow


def test_a_step_larger_than_the_free_memory_is_one_line_before_the_first_step(tmp_path, capsys, monkeypatch):
  """Instead of the allocator's error on one GPU (and the others waiting for it forever): one line after the
  compile, with the hint of --ep-buffer-factor on a mesh that has the safe buffers (and of remat where the run has
  none), and no run folder. The step
  needs its temp buffer and the outputs not written over donated inputs."""
  from sparsejax import cli
  from sparsejax import train as loop
  monkeypatch.setattr(loop, "free_device_bytes", lambda devices: 1024)
  monkeypatch.setattr(loop, "state_bytes_per_device", lambda cfg, model_cfg: 0)  # the params fit; the step does not
  argv = ["--preset", "tiny-moe", "--data", _corpus(tmp_path), "--steps", "1", "--batch-size", "8", "--seq-len", "16",
          "--no-progress", "--out", str(tmp_path / "run")]
  for k, v in TINY.items():
    argv += ["--set", f"{k}={v}"]
  with pytest.raises(SystemExit) as e:
    cli.main([*argv, "--mesh", "expert=8"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count("\n") == 1 and "GiB is free: pass a smaller --batch-size" in err, err
  assert "--ep-buffer-factor (e.g. 1.5)" in err and not (tmp_path / "run").exists()
  # The rule on its own: the hint only where the safe buffers are in use; nothing where memory is not reported.
  import types
  step = types.SimpleNamespace(memory_analysis=lambda: types.SimpleNamespace(
      temp_size_in_bytes=3 * 2**30, output_size_in_bytes=2**30, alias_size_in_bytes=2**30))
  for cfg, hint, remat in ((TrainConfig(mesh="expert=8", ep_buffer_factor=2.0), False, True),
                           (TrainConfig(), False, True), (TrainConfig(mesh="expert=8"), True, True),
                           (TrainConfig(model_overrides={"remat": "block"}), False, False)):
    monkeypatch.setattr(loop, "free_device_bytes", lambda devices: 2**30)
    with pytest.raises(loop.StepDoesNotFit, match="needs 3.0 GiB a device besides its inputs and 1.0 GiB") as e:
      loop.check_step_memory(step, [], cfg)
    assert ("--ep-buffer-factor" in str(e.value)) == hint
    assert ("--set remat=ffn" in str(e.value)) == remat  # the hint unless the run already recomputes
    for free in (3 * 2**30, None):  # enough, or not reported (the CPU)
      monkeypatch.setattr(loop, "free_device_bytes", lambda devices, free=free: free)
      loop.check_step_memory(step, [], cfg)


@pytest.mark.parametrize("argv, error", [
    (["--ep-buffer-factor", "1.5"], "--ep-buffer-factor sizes the expert-parallel exchange: it needs --mesh."),
    (["--mesh", "expert=8", "--ep-buffer-factor", "0"], "--ep-buffer-factor must be a finite number > 0"),
    (["--mesh", "expert=8", "--ep-buffer-factor", "x"], "--ep-buffer-factor: invalid float value"),
])
def test_a_bad_exchange_buffer_is_one_line(argv, error, capsys):
  with pytest.raises(SystemExit) as e:
    parse_args(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert error in err and err.count("\n") == 1


@pytest.mark.parametrize("spec, error", [
    ("data=2,expert", "--mesh must be 'data=D,expert=X'"),
    ("data=0,expert=4", "--mesh must be 'data=D,expert=X'"),
    ("tensor=2", "--mesh must be 'data=D,expert=X'"),
    ("data=2,expert_group=0,expert=2", "--mesh must be 'data=D,expert=X'"),
])
def test_a_malformed_mesh_is_one_line(spec, error, capsys):
  with pytest.raises(SystemExit) as e:
    parse_args(["--mesh", spec])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert error in err and err.count("\n") == 1


@pytest.mark.parametrize("overrides, spec, error", [
    ({}, "data=4,expert=4", "needs 16 devices; 8 are visible"),
    ({"num_experts": 6}, "data=2,expert=4", "expert=4 must divide num_experts=6"),
    ({}, "data=1,expert=3", "--batch-size 8 does not split over the 3 devices"),
    ({}, "data=1,expert_group=3,expert=2", "--batch-size 8 does not split over the 6"),
    ({"num_experts": 4}, "data=1,expert_group=2,expert=4", "expert_group x expert = 8 devices must divide num_experts=4"),
    ({}, "data=2,expert_group=4,expert=2", "needs 16 devices; 8 are visible"),
])
def test_a_mesh_that_does_not_fit_fails_before_compiling(tmp_path, overrides, spec, error):
  with pytest.raises(ValueError, match=error):
    prepare(_cfg(tmp_path, "run", mesh=spec, model_overrides={**TINY, **overrides}))
  assert not (tmp_path / "run").exists()


def test_a_checkpoint_moves_between_meshes(tmp_path, one_device):
  """Saved from 1x8 after 2 steps, resumed on 2x4 and on one device: step 3 is the uninterrupted run's."""
  train(_cfg(tmp_path, "a", mesh="data=1,expert=8", steps=2, ckpt_every=2))
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  for name, mesh in (("a", "data=2,expert=4"), ("b", None)):
    train(_cfg(tmp_path, name, mesh=mesh, steps=3, ckpt_every=2))
    np.testing.assert_allclose(_losses(tmp_path / name), one_device[0], rtol=2e-5)


def test_fewer_experts_than_devices_slice_d_ff():
  """E = 4 on expert=8: each expert's d_ff is split over the two devices of its slice axis."""
  from flax import nnx

  from sparsejax.mesh import make_expert_mesh
  from sparsejax.models import Transformer, get_preset
  from sparsejax.train import param_shardings
  mesh = make_expert_mesh(1, 8)
  model = Transformer(get_preset("tiny-moe", **{**TINY, "num_experts": 4}), rngs=nnx.Rngs(0), mesh=mesh)
  ffn = param_shardings(model, mesh, 4)["blocks"][0]["ffn"]
  assert ffn["w_in"].spec == P("expert", None, "expert_slice") and ffn["w_out"].spec == P("expert", "expert_slice", None)
  assert ffn["w_in"].shard_shape((4, 32, 64)) == (1, 32, 32)


def test_the_flag_reaches_the_config():
  assert parse_args(["--mesh", "data=2,expert=4"]).mesh_shape() == {"data": 2, "expert": 4}
  assert parse_args(["--mesh", "expert=8"]).mesh_shape() == {"data": 1, "expert": 8}
  assert parse_args(["--mesh", "data=2,expert_group=2,expert=2"]).mesh_shape() == {
      "data": 2, "expert_group": 2, "expert": 2}
  assert parse_args([]).mesh is None
  assert parse_args(["--mesh", "expert=8", "--ep-buffer-factor", "1.5"]).ep_buffer_factor == 1.5


def test_hidden_remat_under_expert_parallelism_keeps_the_exchanged_rows():
  """remat='hidden' with experts sharded: the float32 gradients without remat, and the backward exchanges the rows
  (d_model wide) no more often than without remat: it keeps what the exchanges brought; 'ffn' runs them again. With
  a buffer of 1.5x the mean it keeps less than with the safe buffers: not the fallback's worst-case rows too."""
  from sparsejax.parallel import ExpertParallelConfig
  import jax.numpy as jnp
  from flax import nnx

  from sparsejax import mesh as meshlib
  from sparsejax.models import Transformer, TransformerConfig, cross_entropy
  # 4 experts a device at top-1: a receiver's 1.5x bound (96 rows) is well under its worst case (256)
  cfg = TransformerConfig(d_model=32, num_layers=1, num_heads=4, d_ff=128, num_experts=16, top_k=1, moe_every=1,
                          max_seq_len=64)
  mesh = meshlib.make_expert_mesh(1, 4)
  tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, 256)

  def grads_and_row_exchanges(remat, buffer_factor=None):
    model = Transformer(cfg.replace(remat=remat), rngs=nnx.Rngs(0), mesh=mesh)
    model.blocks[0].ffn.parallel = ExpertParallelConfig(buffer_factor=buffer_factor)
    graphdef, params = nnx.split(model)

    def loss(p):
      logits, stats = nnx.merge(graphdef, p)(tokens[:, :-1], rng=jax.random.key(3))
      return cross_entropy(logits, tokens[:, 1:]) + stats.aux_loss

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    rows = sum("all_to_all" in e.primitive.name and e.invars[0].aval.shape[-1] == cfg.d_model
               for e in jaxpr_equations(jaxpr))
    _, grads, kept = loss_grads_and_kept_bytes(loss, params)
    return grads, rows, kept

  want, plain, _ = grads_and_row_exchanges("none")
  got, hidden, kept = grads_and_row_exchanges("hidden")
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(w))))
  assert hidden == plain > 0 and grads_and_row_exchanges("ffn")[1] > plain
  got, _, bounded = grads_and_row_exchanges("hidden", 1.5)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(w))))
  assert bounded < 0.95 * kept, (bounded, kept)
