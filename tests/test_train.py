"""The training loop: loss goes down, a killed run resumes on the same curve, CLI and errors."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsejax.models import Transformer, get_preset
from sparsejax.train import TrainConfig, functional, make_optimizer, make_steps, parse_args, train

TINY = dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, num_experts=4, max_seq_len=32)


def _corpus(tmp_path):
  d = tmp_path / "corpus"
  d.mkdir(exist_ok=True)
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "moe", "expert", "router", "token"]
  for i in range(12):
    (d / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 400)))
  return str(d)


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


def _records(path, kind):
  rows = [json.loads(line) for line in open(path)]
  return {r["step"]: r for r in rows if r["kind"] == kind}  # the last record of each step wins


def test_killed_run_resumes_on_the_same_curve(tmp_path):
  cfg = _cfg(tmp_path)
  final = train(cfg)
  assert final["step"] == 6 and np.isfinite(final["val_bpb"])
  full = _records(tmp_path / "run" / "metrics.jsonl", "train")
  # A kill after step 3's checkpoint: drop the step-6 checkpoint and the log, then run the same command.
  import shutil
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
  (tmp_path / "run" / "metrics.jsonl").unlink()
  train(cfg)
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


def test_mesh_hook_matches_single_device(tmp_path):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))  # Auto axes: jit places the rest
  a = train(_cfg(tmp_path, steps=2, out=str(tmp_path / "a"), eval_every=0))
  b = train(_cfg(tmp_path, steps=2, out=str(tmp_path / "b"), eval_every=0), mesh=mesh)
  assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


def test_cli_and_clear_errors(tmp_path):
  cfg = parse_args(["--preset", "xs-moe", "--steps", "5", "--set", "capacity_factor=1.5",
                    "--set", "dtype=bfloat16", "--max-time-s", "60", "--eval-every-s", "5",
                    "--data", "corpus/", "--lr", "1e-3"])
  assert cfg.steps == 5 and cfg.max_time_s == 60.0 and cfg.eval_every_s == 5.0 and cfg.lr == 1e-3
  assert cfg.data == "corpus/" and cfg.upcycle_from is None
  assert cfg.model_config().capacity_factor == 1.5 and cfg.model_config().dtype == "bfloat16"
  with pytest.raises(SystemExit):
    parse_args(["--set", "not_a_field=3"])
  with pytest.raises(FileNotFoundError, match="does not exist"):
    train(_cfg(tmp_path, data=str(tmp_path / "missing")))
  with pytest.raises(ValueError, match="Unknown preset"):
    train(_cfg(tmp_path, preset="huge"))
