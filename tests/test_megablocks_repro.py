"""megablocks_repro's bookkeeping without training: the dense-XS target, merging runs, the table."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import megablocks_repro as mb  # noqa: E402


def _variant(preset, curve, final):
  val = [{"elapsed_s": t, "step": s, "tokens": s * 1000, "val_loss": v} for t, s, v in curve]
  return {"preset": preset, "overrides": {}, "steps": curve[-1][1], "compile_s": 1.0, "tokens_per_s": 1e5,
          "mfu": 0.3, "dropped_fraction": 0.0, "final_val_loss": final, "epochs": 0.5, "val_curve": val}


RESULTS = {
    "dropless": _variant("xs-moe", [(10, 100, 3.0), (20, 200, 1.0)], 1.0),
    "dense": _variant("xs-dense", [(10, 120, 2.5), (20, 240, 2.0)], 2.0),
    "capacity 1.0": _variant("xs-moe", [(10, 100, 3.0), (20, 200, 2.5)], 2.5),
}


def test_target_is_the_dense_xs_final_loss():
  s = mb.summarize(RESULTS)
  assert s["target_val_loss"] == 2.0
  assert s["time_to_target_s"] == {"dropless": 15.0, "dense": 20.0, "capacity 1.0": None}
  assert s["tokens_to_target"]["dropless"] == 150_000  # halfway between the evaluations at 100 and 200 steps


def test_no_target_without_dense_xs():
  s = mb.summarize({"dropless": RESULTS["dropless"]})
  assert s["target_val_loss"] is None and s["time_to_target_s"] == {"dropless": None}


def test_merge_keeps_earlier_variants_and_refuses_other_settings(tmp_path):
  settings = {"device": "H100", "smoke": False, "budget_s": 300.0, "batch_size": 32, "seq_len": 1024,
              "data": "site-packages", "adam_mu_dtype": "float32", "grad_accum": 1}
  path = tmp_path / "megablocks.json"
  assert mb.load_for_merge(path, settings) == {}  # nothing yet: a fresh start
  path.write_text(json.dumps({**settings, "variants": {"dense": RESULTS["dense"]}}))
  assert set(mb.load_for_merge(path, settings)) == {"dense"}
  with pytest.raises(SystemExit, match="budget_s: 300.0 there, 40.0 here"):
    mb.load_for_merge(path, {**settings, "budget_s": 40.0})
  with pytest.raises(SystemExit, match="device"):
    mb.load_for_merge(path, {**settings, "device": "H200"})
  with pytest.raises(SystemExit, match="data: 'site-packages' there, 'stdlib' here"):
    mb.load_for_merge(path, {**settings, "data": "stdlib"})
  # A file from before the optimizer settings were recorded ran float32 moments, one batch a step.
  older = {k: v for k, v in settings.items() if k not in ("adam_mu_dtype", "grad_accum")}
  path.write_text(json.dumps({**older, "variants": {"dense": RESULTS["dense"]}}))
  assert set(mb.load_for_merge(path, settings)) == {"dense"}
  with pytest.raises(SystemExit, match="adam_mu_dtype: 'float32' there, 'bfloat16' here"):
    mb.load_for_merge(path, {**settings, "adam_mu_dtype": "bfloat16"})
  with pytest.raises(SystemExit, match="grad_accum: 1 there, 4 here"):
    mb.load_for_merge(path, {**settings, "grad_accum": 4})


def test_table_lists_every_variant():
  report = {"device": "H100", "budget_s": 300.0, "batch_size": 32, "seq_len": 1024, "data": "stdlib",
            "variants": RESULTS, **mb.summarize(RESULTS)}
  text = mb.table(report)
  assert "| dropless | xs-moe |" in text and "15.0 s" in text and "not reached" in text
  assert "corpus stdlib;" in text and "| 200 | 0.50 |" in text and "| 240 | 0.50 |" in text
  assert "microbatches" not in text
  assert "4 microbatches of 8 a step;" in mb.table({**report, "grad_accum": 4})
