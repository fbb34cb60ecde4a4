"""Checkpoints: round trip, keep-last-K, the identical next step after restore, crashed writes ignored."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparsejax.checkpoint import Checkpointer
from sparsejax.models import Transformer, get_preset
from sparsejax.train import TrainConfig, functional, make_optimizer, make_steps

TINY = dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, num_experts=4, max_seq_len=32)


def test_restore_gives_the_identical_next_step(tmp_path):
  apply, params = functional(Transformer(get_preset("tiny-moe", **TINY), rngs=nnx.Rngs(0)))
  tx = make_optimizer(TrainConfig(steps=10, warmup=2))
  opt_state = tx.init(params)
  # Committed to a device, as restored arrays are, so that the step compiles once for all its calls.
  params, opt_state = jax.device_put((params, opt_state), jax.devices()[0])
  step, _ = make_steps(apply, tx, seed=0)
  tok = jax.random.randint(jax.random.key(0), (2, 2, 17), 0, 256)
  params, opt_state, _ = step(params, opt_state, tok[0, :, :-1], tok[0, :, 1:], jnp.int32(0))
  ckpt = Checkpointer(tmp_path, every=1, keep=2)
  ckpt.save(1, {"params": params, "opt_state": opt_state}, {"step": 1, "data": {"seed": 0, "position": 1}})
  template = {"params": jax.tree.map(jnp.zeros_like, params), "opt_state": jax.tree.map(jnp.zeros_like, opt_state)}
  items, meta = Checkpointer(tmp_path).restore(template)
  assert meta == {"step": 1, "data": {"seed": 0, "position": 1}}
  assert jax.tree.structure(items["opt_state"]) == jax.tree.structure(opt_state)
  _, _, m_restored = step(items["params"], items["opt_state"], tok[1, :, :-1], tok[1, :, 1:], jnp.int32(1))
  _, _, m_live = step(params, opt_state, tok[1, :, :-1], tok[1, :, 1:], jnp.int32(1))
  assert float(m_restored["loss"]) == float(m_live["loss"])
  assert float(m_restored["grad_norm"]) == float(m_live["grad_norm"])


def test_interval_keep_last_and_crashed_writes(tmp_path):
  ckpt = Checkpointer(tmp_path, every=2, keep=2)
  for s in range(1, 8):
    ckpt.save(s, {"x": {"w": jnp.full((3,), float(s))}}, {"step": s})
  ckpt.save(7, {"x": {"w": jnp.full((3,), 7.0)}}, {"step": 7}, force=True)
  assert ckpt.all_steps() == [6, 7]
  # What a write killed half way leaves behind: orbax's temporary directory, never finalized.
  stale = tmp_path / "9.orbax-checkpoint-tmp-1234567"
  (stale / "x").mkdir(parents=True)
  (stale / "x" / "garbage").write_bytes(b"\x00" * 10)
  fresh = Checkpointer(tmp_path, every=2, keep=2)
  assert fresh.latest_step() == 7
  items, meta = fresh.restore({"x": {"w": jnp.zeros(3)}})
  np.testing.assert_array_equal(items["x"]["w"], 7.0)
  assert fresh.restore_meta() == {"step": 7}
  # Every `every` steps and nothing else: not the first step of a run (orbax's default policy would).
  spaced = Checkpointer(tmp_path / "spaced", every=3, keep=10)
  saved = [s for s in range(1, 8) if spaced.save(s, {"x": {"w": jnp.zeros(2)}}, {"step": s})]
  assert saved == spaced.all_steps() == [3, 6]


def test_a_damaged_step_is_one_line_naming_the_step_to_fall_back_to(tmp_path):
  """Files deleted or truncated after a step was written: orbax's errors run to hundreds of lines."""
  import shutil

  import pytest

  from sparsejax.checkpoint import CheckpointError
  ckpt = Checkpointer(tmp_path / "c", every=1, keep=3)
  for step in (1, 2):
    ckpt.save(step, {"params": {"w": jnp.full((4,), float(step))}}, {"step": step})
  ckpt.close()
  shutil.rmtree(tmp_path / "c" / "2" / "params")
  ckpt = Checkpointer(tmp_path / "c")
  with pytest.raises(CheckpointError, match=r"checkpoint step 2 in .* cannot be read \(KeyError.*resume from step 1") as e:
    ckpt.restore({"params": {"w": jnp.zeros((4,))}})
  assert "\n" not in str(e.value)
  ckpt = Checkpointer(tmp_path / "c")
  assert float(ckpt.restore({"params": {"w": jnp.zeros((4,))}}, step=1)[0]["params"]["w"][0]) == 1.0
  shutil.rmtree(tmp_path / "c" / "1" / "meta")
  with pytest.raises(CheckpointError, match="checkpoint step 1 .* cannot be read"):
    ckpt.restore_meta(1)
