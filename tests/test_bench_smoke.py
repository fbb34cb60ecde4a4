"""experiments/bench_moe_layer.py on the CPU: the smoke run writes its table, its checks can fail,
its timer amortizes the sync, and --merge keeps what a run did not measure."""
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import bench_moe_layer as bench  # noqa: E402
from peers import common, xla  # noqa: E402


@pytest.mark.cpu_suite("it checks that auto picks Triton, interpreted, where no GPU is")
def test_smoke_run_checks_times_and_writes(tmp_path):
  variants = "torch_grouped_mm,balanced_bmm,sparsejax_pallas,sparsejax_triton,jax_ragged_dot_mgpu"
  results = bench.main(["--smoke", "--shapes", "smoke_skewed", "--variants", variants,
                        "--out-dir", str(tmp_path)])
  mlp = {r["variant"]: r for r in results["mlp"]}
  for v in ("balanced_bmm", "sparsejax_pallas"):
    assert mlp[v]["check_ok"], mlp[v]
    assert mlp[v]["rel_err"] < 1e-2 and max(mlp[v]["grad_rel_err"]) < 2e-2
    assert mlp[v]["fwd_tflops"] > 0 and mlp[v]["fwdbwd_tflops"] > 0
  assert mlp["sparsejax_pallas"]["backend"] == "triton"  # no GPU: auto is Triton, interpreted
  assert mlp["sparsejax_triton"]["same_as"] == "sparsejax_pallas"
  assert "GPU-only" in mlp["torch_grouped_mm"]["skipped"]
  assert "GPU-only" in mlp["jax_ragged_dot_mgpu"]["skipped"]
  layer = {r["variant"]: r for r in results["layer"]}
  # Skewed routing overflows capacity 1.0; dropless drops nothing.
  assert layer["dropless"]["dropped_fraction"] == 0 and layer["capacity_1.0"]["dropped_fraction"] > 0
  assert all(r["check_ok"] and r["fwdbwd_ms"] > 0 for r in layer.values())
  saved = json.loads((tmp_path / "moe_layer_cpu_smoke.json").read_text())
  assert {r["variant"] for r in saved["mlp"]} == set(variants.split(","))
  table = (tmp_path / "moe_layer_cpu_smoke.md").read_text()
  assert "| smoke_skewed | sparsejax_pallas | triton |" in table and "| smoke_skewed | dropless |" in table
  assert (tmp_path / "moe_layer_cpu_smoke.png").stat().st_size > 0


def test_check_fails_on_a_wrong_or_nan_output():
  p = common.make_problem(bench.SMOKE_SHAPES[1])  # compiled already by the smoke run
  ref = common.dropless_reference(p)
  mm = lambda a, w: jax.lax.ragged_dot(a, w, p.group_sizes)
  y = common.mlp(mm, p.rows, p.w_in, p.w_out)
  assert common.compare(y, None, ref)["check_ok"]
  assert not common.compare(y * 1.1, None, ref)["check_ok"]
  assert not common.compare(y.at[0, 0].set(jnp.nan), None, ref)["check_ok"]
  grads = (ref.dx, ref.dw_in, ref.dw_out)
  assert common.compare(y, grads, ref)["check_ok"]
  assert not common.compare(y, (ref.dx, ref.dw_in, -ref.dw_out), ref)["check_ok"]


def test_timed_forward_backward_keeps_the_forward_output():
  """The timed fwd+bwd returns y: with y dropped, XLA removed the second product's forward as dead
  code (5 of the 6 products ran), while torch's timed backward pass computes all six."""
  p = common.make_problem(bench.SMOKE_SHAPES[1])
  ref = common.dropless_reference(p)
  case = xla.ragged_dot(p, ref)
  y, grads = case.fwdbwd()
  assert y.shape == p.rows.shape and len(grads) == 3
  assert case.check()["check_ok"]


def test_timer_amortizes_the_sync_over_a_long_repeat():
  calls, syncs = [], []
  def fn():
    time.sleep(0.001)
    calls.append(1)
  t = common.Timer(min_repeat_s=0.01, repeats=3, warmup=1)(fn, syncs.append)
  assert t["iters"] >= 8  # a repeat of >= 10 ms of 1 ms calls
  assert 0.001 <= t["median_s"] < 0.003
  assert len(syncs) < len(calls) / 4  # one sync per repeat, not per call


def test_a_layer_only_run_gets_a_targets_row_and_a_plot_of_its_layers(tmp_path):
  """--layer-only records no MLP: the targets table still lists its shapes, judging only the layer's ratio, and
  the plot draws the layers (it was an empty MLP plot and an empty table)."""
  rec = lambda shape, v, ms: {"shape": shape, "variant": v, "fwdbwd_ms": ms}
  results = {"gpu": "test", "mlp": [], "layer": [rec("a", "dropless", 2.0), rec("a", "capacity_1.0", 1.9),
                                                  rec("b", "dropless", 1.0), rec("b", "capacity_1.0", 1.1)]}
  rows = [line for line in bench.targets(results) if line.startswith("| a |") or line.startswith("| b |")]
  assert rows == ["| a | — | — | — | 0.95 ✗ | no |", "| b | — | — | — | 1.10 ✓ | yes, of those measured |"]
  bench.plot(results, str(tmp_path / "layer.png"))
  assert (tmp_path / "layer.png").stat().st_size > 0


def test_merge_keeps_unmeasured_shape_variant_pairs(tmp_path):
  old = {"mlp": [{"shape": "a", "variant": "x", "v": 1}, {"shape": "a", "variant": "y", "v": 1},
                 {"shape": "b", "variant": "x", "v": 1}], "layer": [{"shape": "a", "layer": "dropless"}]}
  (tmp_path / "r.json").write_text(json.dumps(old))
  new = {"mlp": [{"shape": "a", "variant": "x", "v": 2}], "layer": []}
  merged = bench.merge_previous(new, str(tmp_path / "r.json"))
  assert sorted((r["shape"], r["variant"], r["v"]) for r in merged["mlp"]) == [
      ("a", "x", 2), ("a", "y", 1), ("b", "x", 1)]
  assert merged["layer"] == old["layer"]


@pytest.mark.parametrize("label,want", [("dropless", ("auto", None)), ("dropless_triton", ("triton", None)),
                                        ("capacity_1.25", ("auto", 1.25)), ("rounded", ("auto", None))])
def test_layer_variant_names(label, want):
  assert bench.layer.parse_variant(label) == want


def test_the_rounded_layer_is_checked_against_the_reference_on_its_own_routing():
  """The "rounded" layer (sj.rounded_moe_mlp) on the smoke shape: its check passes on the rounded ids and weights,
  and its record counts what rounding moved."""
  from peers.common import Timer
  s = bench.SMOKE_SHAPES[0]
  rec = bench.layer.bench(s, "rounded", Timer(min_repeat_s=1e-4, repeats=1, warmup=1))
  assert rec["check_ok"] and rec["rel_err"] < 1e-2
  assert 0 < rec["dropped_fraction"] < 0.5 and 0 <= rec["added_fraction"] < 0.5


def test_kernel_timeline_counts_idle_time_once_and_lists_the_last_call():
  from peers.layer import kernel_timeline
  # Two calls of two kernels; in the second, two streams overlap (40-60 within 30-70).
  k = [dict(ts=0, dur=21, name="a"), dict(ts=30, dur=5, name="b"),
       dict(ts=100, dur=40, name="a"), dict(ts=120, dur=42, name="b")]
  lines = kernel_timeline(k, calls=2)
  assert lines[0] == ("Span of the 2 calls' kernels: 0.081 ms per call, some kernel running 0.044, "
                      "GPU idle 0.037")
  assert [ln.split()[-1] for ln in lines[2:]] == ["a", "b"]  # no idle gap: b starts inside a


def test_trace_device_times_splits_hlo_ops_from_kernels(tmp_path):
  """A GPU trace's HLO-op line and its streams' kernels are counted apart, per name; host events
  (another process) are left out."""
  import gzip

  from peers.layer import trace_device_times
  meta = lambda pid, tid, kind, name: dict(ph="M", pid=pid, tid=tid, name=kind, args=dict(name=name))
  events = [meta(1, 0, "process_name", "/device:GPU:0"), meta(1, 5, "thread_name", "XLA Ops"),
            meta(1, 7, "thread_name", "Stream #13(Compute)"), meta(2, 0, "process_name", "/host:CPU"),
            dict(ph="X", pid=1, tid=5, name="fusion.1", ts=0, dur=10),
            dict(ph="X", pid=1, tid=7, name="k", ts=1, dur=8), dict(ph="X", pid=1, tid=7, name="k", ts=20, dur=4),
            dict(ph="X", pid=2, tid=0, name="host work", ts=0, dur=99)]
  path = tmp_path / "t.json.gz"
  with gzip.open(path, "wt") as fh:
    json.dump({"traceEvents": events}, fh)
  total, count, kernels, gpu = trace_device_times(str(path))
  assert gpu and dict(total["XLA Ops"]) == {"fusion.1": 10.0}
  assert dict(total["GPU kernels (all streams)"]) == {"k": 12.0} and count["GPU kernels (all streams)"]["k"] == 2
  assert [e["ts"] for e in kernels] == [1, 20] and "host work" not in str(dict(total))


def test_kernel_table_by_kind_groups_a_models_layers():
  """Grouped by kind, each layer's instance of a kernel (its own HLO op and numbered name) counts as one."""
  from profile_step import kernel_table
  meta = lambda pid, tid, kind, name: dict(ph="M", pid=pid, tid=tid, name=kind, args=dict(name=name))
  kernel = lambda name, op, ts, dur: dict(ph="X", pid=1, tid=7, name=name, ts=ts, dur=dur, args=dict(hlo_op=op))
  events = [meta(1, 0, "process_name", "/device:GPU:0"), meta(1, 7, "thread_name", "Stream #13(Compute)"),
            kernel("loop_add_fusion_49", "loop_add_fusion.49", 0, 3), kernel("sparsejax_skinny_matmul", "pallas_call.12", 5, 6),
            kernel("loop_add_fusion_50", "loop_add_fusion.50", 20, 3), kernel("sparsejax_skinny_matmul", "pallas_call.30", 30, 6),
            kernel("sparsejax_skinny_matmul__1", "pallas_call.31", 40, 2)]  # another kernel of the same name
  by_op = kernel_table({"traceEvents": events}, steps=1)
  assert len(by_op["kernels"]) == 5
  by_kind = kernel_table({"traceEvents": events}, steps=1, by_kind=True)
  assert by_kind["kernels"] == [("sparsejax_skinny_matmul", 0.012, 2), ("loop_add_fusion", 0.006, 2),
                                ("sparsejax_skinny_matmul__1", 0.002, 1)]
  assert by_kind["busy_union_ms"] == 0.02
