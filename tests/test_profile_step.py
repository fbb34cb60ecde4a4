"""experiments/profile_step.py: op categories from HLO metadata, self times from a trace, and a CPU run."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import profile_step  # noqa: E402


@pytest.mark.parametrize("op_name,opcode,category", [
    ("jit(train_step)/jvp(expert_ffn)/ragged_dot_general", "dot", "expert/ffn matmuls"),
    ("jit(train_step)/transpose(jvp(expert_ffn))/pallas_call", "custom-call", "expert/ffn matmuls"),
    ("jit(train_step)/jvp(expert_ffn)/tanh", "tanh", "activation"),
    ("jit(train_step)/jvp(expert_ffn)/sparsejax_gmm/while/body/add", "add", "expert/ffn matmuls"),
    ("jit(train_step)/jvp(dense_mlp)/dot_general", "dot", "expert/ffn matmuls"),
    ("jit(train_step)/transpose(jvp(attention))/vmap(BNTS,BSNH->BTNH)/dot_general", "dot", "attention"),
    ("jit(train_step)/jvp(placement)/jit(argsort)/sort", "sort", "placement"),
    ("jit(train_step)/transpose(jvp(scatter_rows))/scatter-add", "scatter", "gather/scatter"),
    ("jit(train_step)/jvp(router)/top_k", "custom-call", "router and top-k"),
    ("jit(train_step)/optimizer/jit(norm)/sqrt", "sqrt", "optimizer"),  # jit(norm) is no RMSNorm
    ("jit(train_step)/add", "add", "optimizer"),  # apply_updates: outside the differentiated loss
    ("jit(train_step)/jvp()/add", "add", "other"),  # residual add
    ("params['head']", "copy", "other"),
])
def test_classify(op_name, opcode, category):
  assert profile_step.classify(op_name, opcode) == category


HLO = """HloModule jit_train_step, entry_computation_layout={()->f32[]}

%fused_computation (param_0: f32[8,4], param_1: f32[4,4]) -> f32[8,4] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  %param_1 = f32[4,4]{1,0} parameter(1)
  %dot.1 = f32[8,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/jvp(attention)/dot_general"}
  ROOT %tanh.2 = f32[8,4]{1,0} tanh(%dot.1), metadata={op_name="jit(train_step)/jvp(expert_ffn)/tanh"}
}

ENTRY %main (p: f32[8,4], w: f32[4,4]) -> (f32[8,4], s32[8]) {
  %p = f32[8,4]{1,0} parameter(0)
  %w = f32[4,4]{1,0} parameter(1)
  %fusion.3 = f32[8,4]{1,0} fusion(%p, %w), kind=kOutput, calls=%fused_computation, metadata={op_name="jit(train_step)/jvp(expert_ffn)/tanh"}
  %sort.4 = (s32[8]{0}, s32[8]{0}) sort(%p), dimensions={0}, metadata={op_name="jit(train_step)/jvp(placement)/sort"}
  ROOT %t = (f32[8,4], s32[8]) tuple(%fusion.3, %sort.4)
}
"""


def test_fusion_takes_the_category_of_its_heaviest_op():
  cats = profile_step.op_categories(HLO)
  assert cats["fusion.3"] == "attention"  # the dot outweighs the fused tanh
  assert cats["sort.4"] == "placement"
  assert cats["dot.1"] == "attention" and cats["tanh.2"] == "activation"


def _gpu_trace():
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
          {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
  op = lambda tid, ts, dur, hlo_op, module="jit_train_step": {
      "ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": "kernel",
      "args": {"hlo_op": hlo_op, "hlo_module": module} if hlo_op else {}}
  events = [op(7, 0, 10, "fusion.3"), op(7, 10, 4, "sort.4"), op(7, 20, 3, None),  # a copy with no op
            op(7, 30, 5, "fusion.3", module="jit_other"),  # another program: not counted
            op(8, 0, 14, "fusion.3"),  # the derived line repeats the stream: not counted twice
            {"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 50, "name": "host", "args": {"hlo_op": "sort.4"}}]
  return {"traceEvents": meta + events}


def test_op_times_reads_the_stream_lines_of_the_device():
  times, unattributed = profile_step.op_times(_gpu_trace(), "jit_train_step")
  assert times == {"fusion.3": 10, "sort.4": 4} and unattributed == 3


def test_op_times_counts_self_time_of_nested_events():
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
  ev = lambda ts, dur, op: {"ph": "X", "pid": 1, "tid": 3, "ts": ts, "dur": dur, "name": op,
                            "args": {"hlo_op": op, "hlo_module": "jit_train_step"}}
  trace = {"traceEvents": meta + [ev(0, 10, "while.1"), ev(1, 3, "fusion.2"), ev(5, 2, "fusion.3"), ev(12, 1, "sort.4")]}
  times, _ = profile_step.op_times(trace, "jit_train_step")
  assert times == {"while.1": 5, "fusion.2": 3, "fusion.3": 2, "sort.4": 1}


def test_op_times_keeps_the_time_of_overlapping_neighbours():
  """Two kernels of one stream whose timestamps overlap by a little are neighbours, not nested: the
  first keeps its time (an earlier version took the second's whole duration off the first)."""
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}}]
  ev = lambda ts, dur, op: {"ph": "X", "pid": 1, "tid": 7, "ts": ts, "dur": dur, "name": "k",
                            "args": {"hlo_op": op, "hlo_module": "jit_train_step"}}
  trace = {"traceEvents": meta + [ev(0, 100, "loop_add_fusion.1"), ev(99.9, 50, "fusion.2")]}
  times, _ = profile_step.op_times(trace, "jit_train_step")
  assert times == {"loop_add_fusion.1": 100, "fusion.2": 50}
  gaps = profile_step.kernel_table(trace, steps=1)
  assert abs(gaps["busy_union_ms"] - 0.1499) < 1e-9


@pytest.mark.cpu_suite("at the tiny preset a GPU fuses the router's ops into kernels that vote for other categories")
def test_profile_step_smoke(tmp_path, monkeypatch):
  """A real trace of the tiny MoE's train step on the CPU: every category named, and they add up.
  The step accumulates two microbatches (--grad-accum), and --tag names the files.

  $OUT is --out itself, as on the device machine: the copy into $OUT is skipped, not a SameFileError."""
  monkeypatch.setenv("OUT", str(tmp_path))
  monkeypatch.setenv("XLA_FLAGS", __import__("os").environ.get("XLA_FLAGS", ""))  # restored afterwards
  # The script frees each preset's executables (jax.clear_caches, for GPU memory); in a test worker that
  # would empty every compile cache of the process (seconds, more as the worker's caches grow, and the
  # later tests' recompiles). Nothing checked here depends on it.
  monkeypatch.setattr(profile_step.jax, "clear_caches", lambda: None)
  (tmp_path / "data.txt").write_text("def f(x):\n  return x + 1\n" * 300)
  report = profile_step.main(["--smoke", "--presets", "tiny-moe", "--data", str(tmp_path / "data.txt"),
                              "--out", str(tmp_path), "--grad-accum", "2", "--tag", "_b2x2"])
  r = report["results"][0]
  cats = r["categories_ms"]
  assert set(cats) == set(profile_step.CATEGORIES)
  assert sum(cats.values()) == pytest.approx(r["device_ms"], rel=1e-9)
  assert sum(r["share"].values()) == pytest.approx(1.0)
  for c in profile_step.MOE_CATEGORIES + ("expert/ffn matmuls", "attention", "optimizer"):
    assert cats[c] > 0, c
  assert cats["other"] < 0.5 * r["device_ms"]  # the scopes name most of the step
  saved = json.loads((tmp_path / "profile_b2x2_tiny-moe_cpu.json").read_text())
  assert saved["grad_accum"] == 2
  assert saved["categories_ms"] == cats and "6 N_active" in saved["flop_convention"]
  # Every op is kept, and the ops of a category add up to it.
  router = sum(o["ms"] for o in saved["ops"] if o["category"] == "router and top-k")
  assert router == pytest.approx(cats["router and top-k"], rel=1e-6)
  text = (tmp_path / "profile_b2x2_tiny-moe_cpu.md").read_text()
  assert "| router and top-k |" in text and "(2 microbatches of 1, one AdamW update)" in text
  assert (tmp_path / "profile_b2x2_cpu.md").read_text().count("|") > 20
