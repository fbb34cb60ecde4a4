"""The training loop: loss goes down, the aux loss reaches the gradient, a killed run resumes on the
same curve, MFU counts the devices the run uses. (The command line's errors: tests/test_cli.py.)"""
import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sparsejax.models import Transformer, cross_entropy, get_preset
from sparsejax.train import TrainConfig, functional, make_optimizer, make_steps, mfu, parse_args, peak_flops, train
from corpus_testing import write_corpus

TINY = dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, num_experts=4, max_seq_len=32)


def _corpus(tmp_path):
  return write_corpus(tmp_path, docs=12, words_per_doc=400)


def _cfg(tmp_path, **kw):
  base = dict(preset="tiny-moe", data=_corpus(tmp_path), out=str(tmp_path / "run"), steps=6,
              batch_size=4, seq_len=32, warmup=2, eval_every=3, eval_batches=2, ckpt_every=3, keep=2,
              log_every=1, progress=False, model_overrides=TINY)
  return TrainConfig(**{**base, **kw})


def test_steps_lower_the_loss_on_a_fixed_batch():
  cfg = TrainConfig(lr=1e-2, warmup=1, steps=30)
  apply, params = functional(Transformer(get_preset("tiny-moe", **TINY), rngs=nnx.Rngs(0)))
  tx = make_optimizer(cfg)
  opt_state = tx.init(params)
  step, _ = make_steps(apply, tx, seed=0)
  tokens = jax.random.randint(jax.random.key(0), (4, 33), 0, 256)
  losses = []
  for i in range(15):
    params, opt_state, m = step(params, opt_state, tokens[:, :-1], tokens[:, 1:], jnp.int32(i))
    losses.append(float(m["loss"]))
  assert losses[-1] < 0.7 * losses[0], losses
  assert m["tokens_per_expert"].shape == (1, 4) and int(m["tokens_per_expert"].sum()) == 4 * 32


def test_bfloat16_first_moment_tracks_float32():
  """adam_mu_dtype="bfloat16": mu is stored in bf16 (nu stays float32), and the params after a
  few steps stay within bf16 rounding of the float32-moment run's."""
  tokens = jax.random.randint(jax.random.key(2), (4, 33), 0, 256)
  runs = {}
  for mu_dtype in ("float32", "bfloat16"):
    apply, params = functional(Transformer(get_preset("tiny-moe", **TINY), rngs=nnx.Rngs(0)))
    tx = make_optimizer(TrainConfig(lr=1e-2, warmup=1, steps=30, adam_mu_dtype=mu_dtype))
    opt_state = tx.init(params)
    adam = opt_state[1][0]  # chain(clip, adamw): adamw's first state is ScaleByAdamState
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(mu_dtype)}
    assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype("float32")}
    step, _ = make_steps(apply, tx, seed=0)
    for i in range(4):
      params, opt_state, m = step(params, opt_state, tokens[:, :-1], tokens[:, 1:], jnp.int32(i))
    runs[mu_dtype] = (params, float(m["loss"]))
  (p32, l32), (p16, l16) = runs["float32"], runs["bfloat16"]
  assert abs(l16 - l32) < 1e-2 * l32
  w32, w16 = p32["blocks"][1]["ffn"]["w_in"], p16["blocks"][1]["ffn"]["w_in"]
  assert float(jnp.linalg.norm(w16 - w32) / jnp.linalg.norm(w32)) < 1e-2


def test_aux_loss_reaches_the_router_gradient():
  """The step's loss is ce + lb_weight * load balancing + z_weight * z-loss, gradient included: with SGD
  at lr 1 (params - new params = the gradient), the router's gradient in train_step equals an
  independent jax.grad of that sum, which the aux terms move far beyond the tolerance."""
  tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 256)
  x, y = tokens[:, :-1], tokens[:, 1:]
  model_cfg = get_preset("tiny-moe", **TINY, load_balancing_weight=1.0, z_loss_weight=1.0)
  apply, params = functional(Transformer(model_cfg, rngs=nnx.Rngs(0)))
  before = jax.tree.map(jnp.copy, params)  # train_step donates params
  step, _ = make_steps(apply, optax.sgd(1.0), seed=0)
  after, _, _ = step(params, optax.sgd(1.0).init(params), x, y, jnp.int32(0))
  router = lambda tree: tree["blocks"][1]["ffn"]["router"]["w"]  # tiny-moe: block 1 is the MoE block
  got = router(before) - router(after)

  @jax.jit
  def want(p, lb_w, z_w):
    def loss(p):
      logits, stats = apply(p, x, rng=jax.random.fold_in(jax.random.key(0), 0))
      return cross_entropy(logits, y) + lb_w * stats.load_balancing_loss + z_w * stats.router_z_loss
    return router(jax.grad(loss)(p))

  np.testing.assert_allclose(got, want(before, 1.0, 1.0), rtol=1e-4, atol=1e-7)
  ce_only = want(before, 0.0, 0.0)
  change = np.linalg.norm(got - ce_only) / np.linalg.norm(ce_only)
  assert change > 0.1, change  # a step without the aux loss would fail the comparison above


def test_mfu_formula_and_the_devices_counted():
  # mfu = steps * flops_per_step / seconds / peak
  assert mfu(2e12, 10, 4.0, 1e13) == pytest.approx(0.5)
  assert mfu(2e12, 10, 4.0, None) is None
  assert peak_flops("NVIDIA H100 80GB HBM3", 1) == 989e12
  assert peak_flops("NVIDIA H100 80GB HBM3", 4) == 4 * 989e12  # the devices the run uses, not the host's
  assert peak_flops("NVIDIA H200", 2, per_device=1e15) == 2e15
  assert peak_flops("cpu", 8) is None


def _records(path, kind):
  rows = [json.loads(line) for line in open(path)]
  return {r["step"]: r for r in rows if r["kind"] == kind}  # the last record of each step wins


def test_killed_run_resumes_on_the_same_curve(tmp_path, capsys):
  cfg = _cfg(tmp_path)
  final = train(cfg)
  assert final["step"] == 6 and np.isfinite(final["val_bpb"])
  full = _records(tmp_path / "run" / "metrics.jsonl", "train")
  # A kill after step 3's checkpoint: drop the step-6 checkpoint and the log, then run the same command.
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
  (tmp_path / "run" / "metrics.jsonl").unlink()
  capsys.readouterr()
  train(cfg)
  assert "resumed from step 3" in capsys.readouterr().out
  resumed = _records(tmp_path / "run" / "metrics.jsonl", "train")
  assert sorted(resumed) == [4, 5, 6]
  for s in (4, 5, 6):
    assert resumed[s]["loss"] == full[s]["loss"], s  # bit-identical, not merely close
    assert resumed[s]["tokens_per_expert"] == full[s]["tokens_per_expert"]
  # The metrics hold what the plots and the experiment need.
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  t = [r for r in rows if r["kind"] == "train"][-1]
  for key in ("loss", "aux_loss", "lb_loss", "z_loss", "tokens_per_s", "mfu", "elapsed_s",
              "tokens_per_expert", "dropped_fraction"):
    assert key in t
  v = [r for r in rows if r["kind"] == "val"][-1]
  assert v["val_bpb"] == pytest.approx(v["val_loss"] / np.log(2))


def test_progress_lines_before_the_first_logged_step_show_no_train_loss(tmp_path, capsys):
  """An evaluation before the first logged step has no train loss to print: it prints none, not nan."""
  train(_cfg(tmp_path, steps=3, log_every=5, eval_every=2, ckpt_every=10))
  out = capsys.readouterr().out
  line = next(l for l in out.splitlines() if l.startswith("step      2 |"))
  assert "val loss" in line and "val bits/byte" in line and "train loss" not in line and "nan" not in out
  assert "val bits per byte" in out.splitlines()[-1]


def test_a_token_corpus_reports_bits_per_token_and_a_finished_run_says_it_trains_nothing(tmp_path, capsys):
  """A .bin corpus's tokens are not bytes; --steps at or below the checkpoint's step trains nothing, and says so."""
  np.random.default_rng(0).integers(0, 300, 4000).astype(np.uint16).tofile(tmp_path / "tok.bin")
  cfg = _cfg(tmp_path, data=str(tmp_path / "tok.bin"), steps=2, eval_every=0, ckpt_every=2)
  train(cfg)
  done = capsys.readouterr().out.splitlines()[-1]
  assert done.startswith("done: step 2") and "val bits per token" in done and "byte" not in done
  train(dataclasses.replace(cfg, steps=1))
  out = capsys.readouterr().out
  assert "--steps 1 is not above the checkpoint's step 2, so nothing will be trained" in out
  assert "done: step 2" in out


@pytest.mark.devices(8)
def test_mesh_hook_matches_single_device(tmp_path):
  """Same loss on a 2-device data mesh; MFU divides by the peak of the devices the run uses (1, then 2)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))  # Auto axes: jit places the rest
  a = train(_cfg(tmp_path, steps=2, out=str(tmp_path / "a"), eval_every=0, peak_flops=1e9))
  b = train(_cfg(tmp_path, steps=2, out=str(tmp_path / "b"), eval_every=0, peak_flops=1e9), mesh=mesh)
  assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
  flops_per_token = get_preset("tiny-moe", **TINY).flops_per_token(32)
  assert len(jax.devices()) == 8  # conftest: so a count of the host's devices would show
  for final, devices in ((a, 1), (b, 2)):
    assert final["mfu"] == pytest.approx(final["tokens_per_s"] * flops_per_token / (1e9 * devices), rel=1e-6)


def test_parse_args():
  cfg = parse_args(["--preset", "xs-moe", "--steps", "5", "--set", "capacity_factor=1.5",
                    "--set", "dtype=bfloat16", "--max-time-s", "60", "--eval-every-s", "5",
                    "--data", "corpus/", "--lr", "1e-3", "--allow-binary"])
  assert cfg.steps == 5 and cfg.max_time_s == 60.0 and cfg.eval_every_s == 5.0 and cfg.lr == 1e-3
  assert cfg.data == "corpus/" and cfg.upcycle_from is None and cfg.allow_binary
  assert cfg.model_config().capacity_factor == 1.5 and cfg.model_config().dtype == "bfloat16"
  assert parse_args([]) == TrainConfig()  # the command's defaults are the library's


def test_a_time_limit_holds_whatever_log_every_says_and_the_last_evaluation_is_not_repeated(tmp_path, capsys):
  """--max-time-s was read only on --log-every's steps: with a large one it was ignored. Stopped right after a
  timed evaluation, the run kept that record instead of writing a second, identical one."""
  final = train(_cfg(tmp_path, steps=100_000, max_time_s=0.5, eval_every=0, eval_every_s=0.2, log_every=10**6,
                     ckpt_every=0))
  assert final["step"] < 100_000
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  val_steps = [r["step"] for r in records if r["kind"] == "val"]
  assert len(val_steps) == len(set(val_steps)) and val_steps[-1] == final["step"]
  assert [r["step"] for r in records if r["kind"] == "train"][-1] == final["step"]  # the last step is logged
  # Resumed with the time spent: it says so and trains nothing.
  capsys.readouterr()
  timed = _cfg(tmp_path, out=str(tmp_path / "timed"), steps=100_000, max_time_s=0.5, eval_every=0,
               log_every=10**6, ckpt_every=10**6)  # one checkpoint, at the end
  train(timed)
  train(timed)
  assert "--max-time-s 0.5 is spent" in capsys.readouterr().out
