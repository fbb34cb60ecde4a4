"""Sparse upcycling: the MoE model equals the dense one at initialization (top-1, renormalized)."""
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from sparsejax.models import Transformer, get_preset
from sparsejax.train import TrainConfig, prepare, train
from sparsejax.upcycle import upcycle, upcycle_config

TINY = dict(d_model=32, num_layers=4, num_heads=2, d_ff=64, max_seq_len=32)


@pytest.mark.parametrize("glu", [False, True])
def test_upcycled_model_equals_dense_at_init(glu):
  dense_cfg = get_preset("tiny-dense", **TINY, glu=glu, activation="silu")
  dense = Transformer(dense_cfg, rngs=nnx.Rngs(3))
  moe_cfg = upcycle_config(dense_cfg, num_experts=4, top_k=1, renormalize=True)
  moe = upcycle(dense, moe_cfg, seed=5)
  assert [b.is_moe for b in moe.blocks] == [False, True, False, True]  # every other layer
  tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 256)
  forward = nnx.jit(lambda model, tokens: model(tokens))  # one compile each, not one per op
  want, _ = forward(dense, tokens)
  got, stats = forward(moe, tokens)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert stats.tokens_per_expert.shape == (2, 4)
  # The router is fresh (not zeros): different experts are picked, and all give the same answer.
  assert int((stats.tokens_per_expert > 0).sum()) > 2


def test_mismatched_configs_are_refused():
  dense = Transformer(get_preset("tiny-dense", **TINY), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="d_ff"):
    upcycle(dense, upcycle_config(dense.cfg).replace(d_ff=128))


def test_train_from_dense_checkpoint(tmp_path):
  (tmp_path / "data.txt").write_text("the experts start equal and then diverge. " * 300)
  common = dict(data=str(tmp_path / "data.txt"), steps=3, batch_size=2, seq_len=32, eval_every=0,
                eval_batches=1, log_every=1, progress=False)
  train(TrainConfig(preset="tiny-dense", out=str(tmp_path / "dense"), model_overrides=TINY, **common))
  final = train(TrainConfig(preset="tiny-moe", out=str(tmp_path / "moe"), upcycle_from=str(tmp_path / "dense"),
                            model_overrides={**TINY, "num_experts": 4, "renormalize": True}, **common))
  assert final["step"] == 3 and np.isfinite(final["val_loss"])
  assert np.array(final["tokens_per_expert"]).shape == (2, 4)
  # A preset that does not fit the dense run, or a folder without a checkpoint, fails before training.
  bad = TrainConfig(preset="tiny-moe", out=str(tmp_path / "bad"), upcycle_from=str(tmp_path / "dense"),
                    model_overrides={**TINY, "num_experts": 4, "d_ff": 128}, **common)
  with pytest.raises(ValueError, match="d_ff 64 there, 128 here"):
    prepare(bad)
  # Renormalized by default (the upcycled model is the dense one at step 0); an explicit --set stands.
  ok = dataclasses.replace(bad, model_overrides={**TINY, "num_experts": 4})
  assert prepare(ok).model_cfg.renormalize is True
  assert prepare(dataclasses.replace(ok, model_overrides={**TINY, "num_experts": 4, "renormalize": False}
                                     )).model_cfg.renormalize is False
  with pytest.raises(ValueError, match="rope_base 10000.0 there, 500.0 here"):  # positions the weights know
    prepare(dataclasses.replace(ok, model_overrides={**TINY, "num_experts": 4, "rope_base": 500.0}))
  with pytest.raises(ValueError, match="holds an MoE model .*upcycling starts from a dense run"):
    prepare(dataclasses.replace(ok, upcycle_from=str(tmp_path / "moe")))
  (tmp_path / "empty_run").mkdir()
  with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
    prepare(dataclasses.replace(bad, upcycle_from=str(tmp_path / "empty_run")))
  assert not (tmp_path / "bad").exists()
