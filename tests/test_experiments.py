"""The experiment scripts run end to end on the CPU (smoke sizes) and write what they promise."""
import functools
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import megablocks_repro  # noqa: E402
import provenance  # noqa: E402
import plot  # noqa: E402
from sparsejax.kernels.pallas_triton_gpu import lower_for_gpu  # noqa: E402


def test_megablocks_smoke(tmp_path):
  (tmp_path / "data.txt").write_text("dropless experts never drop a token. " * 400)
  report = megablocks_repro.main([
      "--smoke", "--budget-s", "0.6", "--evals", "2", "--eval-batches", "1", "--no-progress",
      "--data", str(tmp_path / "data.txt"), "--out", str(tmp_path / "res"),
      "--variants", "dropless", "capacity 1.0", "dense"])
  saved = json.loads((tmp_path / "res" / "megablocks_smoke.json").read_text())
  assert set(saved["variants"]) == {"dropless", "capacity 1.0", "dense"}
  assert (tmp_path / "res" / "megablocks_smoke_val_loss.png").stat().st_size > 0
  v = report["variants"]
  assert v["dropless"]["dropped_fraction"] == 0.0 and v["dense"]["dropped_fraction"] == 0.0
  assert v["capacity 1.0"]["dropped_fraction"] > 0.0  # an untrained router overloads some expert
  assert all(r["tokens_per_s"] > 0 and r["val_curve"] for r in v.values())
  assert saved["data"] == str(tmp_path / "data.txt") and all(r["epochs"] > 0 for r in v.values())
  assert report["time_to_target_s"]  # every variant reaches the worst variant's best loss
  # The plot script reads the runs the experiment left behind.
  paths = plot.plot_runs([str(tmp_path / "res" / "runs_smoke" / "dropless")], tmp_path / "plots")
  assert {p.name for p in paths} == {"loss_vs_steps.png", "loss_vs_time.png", "expert_load_dropless.png"}


def test_time_to_reach_interpolates():
  curve = [{"elapsed_s": 1.0, "val_loss": 3.0}, {"elapsed_s": 3.0, "val_loss": 2.0}]
  assert megablocks_repro.time_to_reach(curve, 2.5) == 2.0
  assert megablocks_repro.time_to_reach(curve, 1.0) is None


def test_plot_errors_are_one_line(tmp_path, capsys, monkeypatch):
  with pytest.raises(SystemExit) as e:
    plot.main([str(tmp_path / "no_run"), "--out", str(tmp_path / "plots")])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count("\n") == 1 and "no metrics file at" in err, err
  # Without matplotlib (the base install): one line naming the extra that brings it.
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 1.0}) + "\n")
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
  with pytest.raises(SystemExit) as e:
    plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "plots")])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count("\n") == 1 and 'pip install -e ".[plot]"' in err, err
  assert not (tmp_path / "plots").exists()


def test_exchange_bench_checks_every_variant_against_dense():
  import bench_exchange
  rows = bench_exchange.main(["--smoke", "--chunks", "1,3"])
  assert [r["variant"] for r in rows] == ["dense", "ragged chunks=1", "ragged chunks=3"]
  assert all(r["equal_to_dense"] and r["ms"] > 0 for r in rows), rows


def test_ep_train_bench_names_the_collectives_and_tables_them():
  import bench_ep_train as b
  kind = lambda name, op="": b.collective_kind({"name": name, "args": {"hlo_op": op} if op else {}})
  assert kind("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "all-to-all"
  assert kind("x", "ragged-all-to-all.29.2") == kind("x", "all_to_all.152.1") == "all-to-all"
  assert kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == kind("x", "all-reduce.3") == "all-reduce"
  assert kind("loop_gather_fusion", "gather.12") is None
  one = {"gpus": 1, "exchange": "none", "step_ms": 30.0, "tokens_per_s": 1e6, "weak_scaling_efficiency": 1.0,
         "collectives_ms": {}, "collective_share": {}, "categories_ms": {"optimizer": 7.0}}
  two = {"gpus": 2, "exchange": "dense", "token_chunks": 2, "step_ms": 40.0, "tokens_per_s": 1.5e6, "weak_scaling_efficiency": 0.75,
         "collectives_ms": {"all-to-all": 8.0}, "collective_share": {"all-to-all": 0.2},
         "collectives_overlapped_ms": {"all-to-all": 1.5}, "categories_ms": {"optimizer": 3.5, "collectives": 8.0}}
  two["memory_gib"] = {"temp": 20.0, "arguments": 3.5}
  # A configuration whose compiled memory did not fit: a row that says so, and none in the other tables.
  big = {"gpus": 4, "exchange": "ragged_compact", "fits": False, "memory_gib": {"temp": 82.15, "arguments": 3.5},
         "weak_scaling_efficiency": None}
  table = b.markdown({"preset": "xs-moe", "batch_per_gpu": 32, "seq_len": 1024, "device_kind": "H200", "jax": "x",
                      "runs": [one, two, big]})
  assert "| 2 | dense | 2 | 40.00 | 1.5e+06 | 75.0% | 8.00 (20.0%) | 1.50 | 0 | 20.00 + 3.50 |" in table
  assert "| 4 | ragged_compact | 1 | does not fit the GPU: not run | | | | | | 82.15 + 3.50 |" in table
  assert table.count("| 4 | ragged_compact |") == 1
  assert "| 2 | dense | 2 | 3.50 | 8.00 |" in table
  assert "| 1 | none | 1 | 30.00 |" in table  # records from before token_chunks read as 1
  assert table.startswith("### MoE training step, weak scaling (xs-moe, 32 x 1024") and "smoke" not in table


def test_ep_train_bench_names_an_ops_defining_hlo_line():
  import bench_ep_train as b
  hlo = ("ENTRY %main {\n  %fusion.1 = bf16[8,4]{1,0} fusion(%p), kind=kLoop\n"
         "  %fusion.12 = f32[2]{0} fusion(%fusion.1), kind=kInput\n  ROOT %t = (f32[2]) tuple(%fusion.12)\n}")
  assert b.hlo_line(hlo, "fusion.1") == "%fusion.1 = bf16[8,4]{1,0} fusion(%p), kind=kLoop"  # not fusion.12, not a use
  assert b.hlo_line(hlo, "t") == "ROOT %t = (f32[2]) tuple(%fusion.12)"
  assert b.hlo_line(hlo, "fusion.12", width=10) == "%fusion.12"
  assert b.hlo_line(hlo, "fusion.7") == ""
  ranked = [("fusion.12", 3.0), ("t", 2.0), ("fusion.1", 1.0)]
  cat_of = {"fusion.12": "other", "t": "placement", "fusion.1": "other"}
  assert b.top_ops(ranked, cat_of, hlo, ("other", "placement"), n=1) == {
      "other": [("fusion.12", 3.0, "%fusion.12 = f32[2]{0} fusion(%fusion.1), kind=kInput")],
      "placement": [("t", 2.0, "ROOT %t = (f32[2]) tuple(%fusion.12)")]}


def test_ep_train_bench_lists_the_two_level_meshes_it_measures():
  import bench_ep_train as b
  assert b.configs([1, 2, 4], ["dense"], [2]) == [(1, None, None), (2, "dense", None), (4, "dense", None), (4, "dense", 2)]
  assert b.configs([8], ["ragged", "dense"], [2, 4, 3]) == [(8, "ragged", None), (8, "dense", None), (8, "dense", 2),
                                                           (8, "dense", 4)]
  assert b.mesh_spec(1, None) is None and b.mesh_spec(4, None) == "data=1,expert=4"
  assert b.mesh_spec(8, 2) == "data=1,expert_group=2,expert=4"


@pytest.mark.devices(4)
def test_ep_train_bench_runs_the_hierarchical_exchange_to_the_flat_ones_losses(tmp_path):
  """--smoke on 4 of the 8 host devices, with an exchange buffer of half the mean rows (so steps
  overflow it and take the exact fallback): the two-level mesh's step (dense, hierarchical 2x2) trains
  from the same state and batches as the flat, compact-send ragged one, so their losses agree; the
  JSON and table name the exchange. (4 devices, not 8: XLA:CPU emulates the ragged exchange with P
  windows of the whole buffer, so a step on 8 devices took seconds, most of the test's time.)"""
  import bench_ep_train as b
  report = b.main(["--smoke", "--no-trace", "--gpus", "4", "--exchanges", "ragged_compact", "--expert-groups", "2",
                   "--buffer-factors", "0.5", "--out", str(tmp_path)])
  runs = {r["exchange"]: r for r in report["runs"]}
  assert list(runs) == ["ragged_compact, buffer 0.5x mean", "dense, hierarchical 2x2, buffer 0.5x mean"]
  flat = runs["ragged_compact, buffer 0.5x mean"]
  assert runs["dense, hierarchical 2x2, buffer 0.5x mean"]["expert_groups"] == 2 and flat["buffer_factor"] == 0.5
  for r in runs.values():  # a smaller buffer that overflows falls back to the safe one: same losses either way
    assert abs(r["loss_first"] - flat["loss_first"]) < 1e-5 and abs(r["loss_last"] - flat["loss_last"]) < 1e-4, r
    assert 0 < r["overflow_steps"][0] <= r["overflow_steps"][1], r  # and the run counts the steps that did
  assert "| 4 | dense, hierarchical 2x2, buffer 0.5x mean | 1 |" in (tmp_path / "ep_train_cpu_smoke_x4.md").read_text()


@pytest.mark.devices(2)
def test_ep_train_bench_sets_model_fields_for_every_run(tmp_path, monkeypatch):
  """--set token_rounding=true reaches the expert-parallel step (it rounds over the exchange group); the JSON and
  the table's title name the override. --dispatches: the step with each, same losses, named."""
  import bench_ep_train as b
  from sparsejax import token_rounding
  calls, real = [], token_rounding.round_to_blocks
  monkeypatch.setattr(token_rounding, "round_to_blocks", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
  report = b.main(["--smoke", "--no-trace", "--gpus", "2", "--exchanges", "dense", "--set", "token_rounding=true",
                   "--dispatches", "assignments,tokens", "--out", str(tmp_path)])
  assert report["model_overrides"] == {"token_rounding": True}
  by_row, by_token = report["runs"]
  assert (by_row["exchange"], by_token["exchange"]) == ("dense, dispatch assignments", "dense, dispatch tokens")
  assert abs(by_row["loss_first"] - by_token["loss_first"]) < 1e-5 and abs(by_row["loss_last"] - by_token["loss_last"]) < 1e-4
  assert calls and all(kw.get("axis_name") == ("expert",) for kw in calls)
  table = (tmp_path / "ep_train_cpu_smoke_x2.md").read_text()
  assert "token_rounding=True" in table
  # The title says it is a smoke run, of a shrunk model (not the preset's), as the other benchmarks' smoke output does.
  assert table.startswith("### MoE training step, weak scaling (smoke run: xs-moe shrunk to d_model=32,")
  assert report["smoke"] is True


def test_remat_bench_checks_each_mode_against_the_step_without_remat(tmp_path):
  """bench_remat --smoke: each mode's step 0 (loss, gradient norm) equals remat=none's, and the files are named
  _smoke; check() reports a mode whose gradients differ."""
  import bench_remat
  report = bench_remat.main(["--smoke", "--modes", "none,ffn", "--groups", "top_k=2", "--out", str(tmp_path)])
  assert [r["mode"] for r in report["records"]] == ["none", "ffn"] and report["mismatches"] == []
  name = f"remat_{report['device'].replace(' ', '_')}_smoke"  # remat_cpu_smoke here; on a GPU its name
  table = (tmp_path / f"{name}.md").read_text()
  assert table.startswith("### Training step by remat mode (smoke run: tiny-moe shrunk to d_model=32")
  assert "| top_k=2 | ffn |" in table and (tmp_path / f"{name}.png").stat().st_size > 0
  wrong = dict(report["records"][1], grad_norm_0=report["records"][1]["grad_norm_0"] * 1.05)
  assert "grad_norm_0" in bench_remat.check([report["records"][0], wrong])[0]


def test_ep_train_bench_refuses_bad_group_counts_buffer_factors_and_exchanges(capsys):
  import bench_ep_train as b
  for flag, bad in (("--expert-groups", "1"), ("--expert-groups", "two"), ("--buffer-factors", "0"),
                    ("--buffer-factors", "none,x"), ("--exchanges", "dense,nccl"), ("--set", "token_rounding")):
    with pytest.raises(SystemExit):
      b.parse_args([flag, bad])
    assert flag in capsys.readouterr().err


def test_ep_train_bench_counts_only_exchange_time_under_other_kernels_of_its_device():
  import bench_ep_train as b
  ev = lambda pid, ts, dur, op: {"pid": pid, "ts": ts, "dur": dur, "name": op, "args": {"hlo_op": op}}
  kernels = [ev(1, 0, 10, "all-to-all.1"), ev(1, 4, 2, "fusion.1"), ev(1, 5, 3, "fusion.2"),  # 4 us hidden
             ev(2, 0, 10, "fusion.3"),                                # another GPU hides nothing of GPU 1
             ev(1, 20, 5, "all-to-all.2"), ev(1, 30, 5, "fusion.4"),  # exposed
             ev(2, 20, 4, "all-reduce.1"), ev(2, 21, 10, "gemm.1")]   # 3 us hidden
  assert b.overlapped_us(kernels) == {"all-to-all": 4.0, "all-reduce": 3.0}


@pytest.mark.cpu_suite("the script's check runs its kernels on the CPU backend")
def test_ncu_script_checks_its_kernels_on_the_cpu():
  """experiments/ncu_gmm_kernels.py --smoke, run as a user runs it (its own process, none of the tests' setup): the
  four Hopper kernels it profiles, interpreted, and its check of each output against the float32 reference (run on
  the CPU, after the kernels). On jax 0.10 it hung in gmm_dact (W_out^T) until it took the interpreter shim itself."""
  import subprocess

  r = subprocess.run([sys.executable, str(ROOT / "experiments" / "ncu_gmm_kernels.py"), "--smoke"], cwd=ROOT,
                     capture_output=True, text=True, timeout=180)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  line = r.stdout.strip().splitlines()[-1]
  assert line.startswith("rel err against the float32 reference:"), r.stdout[-2000:]
  errs = [float(e) for e in line.split(":")[1].split(",")]
  assert len(errs) == 4 and all(0 <= e < 1e-2 for e in errs), line


@pytest.mark.cpu_suite("its smoke run interprets the kernels on the CPU backend")
def test_gmm_skew_bench_smoke_checks_every_product_and_names_its_results_smoke(tmp_path):
  """experiments/bench_gmm_skew.py --smoke at one skewed sigma: gmm and both tgmm orders, interpreted, each checked
  against the reference and timed once (jax 0.10's interpreter hung in tgmm's x^T before the script took the shim);
  the JSON is named _smoke, so it never replaces a measured gmm_skew_<gpu>.json."""
  import bench_gmm_skew

  rows = bench_gmm_skew.main(["--smoke", "--sigmas", "3", "--out-dir", str(tmp_path)])
  (rec,) = rows
  assert rec["sigma"] == 3.0 and rec["max_over_mean"] > 2 and rec["empty_experts"] >= 1
  for name in ("gmm x W_in", "tgmm x^T h (dW_in)", "tgmm, expert order"):
    assert rec[name]["rel_err"] < 2e-2 and rec[name]["ms"] > 0 and len(rec[name]["rounds_ms"]) == 1, name
  (saved,) = tmp_path.glob("*.json")
  assert saved.name == f"gmm_skew_{bench_gmm_skew.jax.devices()[0].device_kind.replace(' ', '_')}_smoke.json"
  assert json.loads(saved.read_text())["rows"] == rows


def test_placement_bench_checks_each_chunk_and_writes_table_json_and_plot(tmp_path):
  """bench_placement --smoke --shapes --chunks: every variant (the default chunk among them) checked equal to the
  argsort placement, one row per shape, routing and variant, and the md, json and png under the tag's name."""
  import bench_placement

  report = bench_placement.main(["--smoke", "--shapes", "40,2,4", "33,1,3", "--chunks", "8", "--tag", "_t",
                                 "--out", str(tmp_path)])
  assert [(r["T"], r["variant"]) for r in report["rows"] if not r["skewed"]] == [
      (T, v) for T in (40, 33) for v in ("argsort", "histogram default", "histogram chunk=8")]
  stem = "placement_cpu_smoke_t"
  assert {f.name for f in tmp_path.iterdir()} == {f"{stem}.json", f"{stem}.md", f"{stem}.png"}
  assert json.loads((tmp_path / f"{stem}.json").read_text())["rows"] == report["rows"]
  with pytest.raises(SystemExit):
    bench_placement.main(["--shapes", "8,5,4"])  # k > E: argparse's one-line error


@pytest.mark.parametrize("epilogue_wg", [False, pytest.param(True, marks=pytest.mark.cpu_suite(
    "it patches the interpret-mode configs, which compiled kernels do not read"))])
def test_energy_probe_cases_run_the_mlps_forms_and_match_their_references(monkeypatch, epilogue_wg):
  """probe_energy --kernels, interpreted on a tiny problem: every case's output against its float32
  reference, with gmm_act and gmm_dact in the forms the fused MLP runs: act'(pre) saved, or pre where
  gmm_act runs the epilogue warpgroup's kernel. The references follow the form, so a mismatch reads ~1."""
  import dataclasses

  import jax
  import mosaic_interpret_compat
  import probe_energy
  import tune_gmm

  from sparsejax.kernels.gmm import mlp, mosaic, mosaic_epilogue

  mosaic_interpret_compat.install()
  mosaic_interpret_compat.compile_thread_bodies_once()
  monkeypatch.setitem(tune_gmm.SHAPES, "tiny", (256, 128, 128, 2, 1))
  if epilogue_wg:
    wg = dataclasses.replace(mosaic_epilogue.CONFIGS["gmm_act"], tile_k=128, max_concurrent_steps=2)
    monkeypatch.setattr(mosaic, "INTERPRET_CONFIGS", dataclasses.replace(mosaic.INTERPRET_CONFIGS, gmm_act=wg))
  cases, _, real = probe_energy.kernel_cases("tiny")
  forward, backward = mlp.activation_forms(jax.nn.gelu, real.shape[0], 2)
  assert isinstance(forward, mosaic.SaveDerivative) != epilogue_wg and (backward is None) != epilogue_wg
  for name, (fn, args, want) in cases.items():
    assert probe_energy.output_error(fn(*args), want, real) < 1e-2, name


def test_ep_train_bench_measures_arrival_skew_and_device_load():
  import bench_ep_train as b
  ev = lambda pid, ts, op: {"pid": pid, "ts": ts, "dur": 1, "name": op, "args": {"hlo_op": op}}
  kernels = [ev(1, 0, "all-to-all.1"), ev(2, 3, "all-to-all.1"), ev(1, 10, "all-to-all.1"), ev(2, 11, "all-to-all.1"),
             ev(1, 5, "all-to-all.2"), ev(2, 5, "all-to-all.2"), ev(1, 7, "fusion.1"), ev(2, 20, "fusion.1")]
  assert b.arrival_skew_us(kernels) == 4.0
  load = b.device_load([[1, 1, 1, 1], [3, 3, 1, 1]], 2)  # layer 2: 6 of 8 tokens on the first device
  assert load == {"mean": 1.25, "max": 1.5}
  assert b.device_load([[1, 1, 1, 1]], 8) is None  # fewer experts than devices: sliced, no shard to count


def test_ep_balance_tables_the_busiest_shard_per_logged_step(tmp_path):
  import ep_balance
  run = tmp_path / "run"
  run.mkdir()
  records = [{"kind": "train", "step": 5, "loss": 4.0, "tokens_per_expert": [[4, 0, 0, 0], [1, 1, 1, 1]]},
             {"kind": "val", "step": 5, "val_loss": 4.1},
             {"kind": "train", "step": 10, "loss": 3.0, "tokens_per_expert": [[2, 2, 2, 2], [3, 1, 2, 2]]}]
  (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
  report = ep_balance.main([str(run), "--shards", "2,4,3", "--name", "t", "--out", str(tmp_path / "out")])
  first, last = report["rows"]
  assert (first["P2_mean"], first["P2_max"]) == (1.5, 2.0)  # layer 1: all 4 tokens on shard 0 of 2
  assert (first["P4_mean"], first["P4_max"]) == (2.5, 4.0)
  assert (last["P2_mean"], last["P4_max"]) == (1.0, 1.5)
  assert "P3_mean" not in first  # 4 experts do not split into 3 shards
  assert (tmp_path / "out" / "ep_balance_t.md").read_text().count("\n| ") == 3
  with pytest.raises(SystemExit, match="no train records"):
    (run / "metrics.jsonl").write_text(json.dumps(records[1]) + "\n")
    ep_balance.main([str(run), "--out", str(tmp_path / "out")])


def test_skinny_matmul_sweep_checks_every_config_on_the_cpu():
  import tune_skinny_matmul
  rows = tune_skinny_matmul.main(["--smoke"])
  # one row: the candidates start at 32 columns
  assert {r["variant"] for r in rows} >= {"xla_dot", "pallas_mulsum_n32_rows128_w4"}
  assert all("error" not in r and r["rel_err"] < 1e-5 for r in rows)
  # Five rows through three experts: the dot form, the int8 weights cast where the kernel loads them.
  rows = tune_skinny_matmul.main(["--smoke", "--rows", "5", "--int8", "--slots", "3"])
  assert [r["variant"] for r in rows] == ["xla_dot", "pallas_dot_n64_rows256_w4", "pallas_dot_n64_rows256_w8"]
  assert all("error" not in r and r["rel_err"] < 1e-5 for r in rows)
  assert all((r["weight"], r["m"], r["slots"]) == ("int8", 5, 3) for r in rows)
  # --k-steps names each program's K step too.
  rows = tune_skinny_matmul.main(["--smoke", "--int8", "--k-steps"])
  assert [r["variant"] for r in rows] == ["xla_dot", "pallas_mulsum_n64_rows128_bk128_w4",
                                          "pallas_mulsum_n64_rows128_bk128_w8"]
  assert all("error" not in r and r["rel_err"] < 1e-5 for r in rows)
  with pytest.raises(SystemExit):
    tune_skinny_matmul.main(["--smoke", "--k-steps", "--rows", "5"])
  # --forms: int8 (k-major) multiply-reduce configs by cast and by float bits (the switch set while it is traced,
  # then restored); the dot form always casts.
  rows = tune_skinny_matmul.main(["--smoke", "--int8", "--forms"])
  assert [r["variant"] for r in rows] == [
      "xla_dot", "pallas_mulsum_n64_rows128_bk128_w4", "pallas_mulsum_n64_rows128_bk128_w4_magic",
      "pallas_mulsum_n64_rows128_bk128_w4_s4", "pallas_mulsum_n64_rows128_bk128_w4_s4_magic"]
  assert all("error" not in r and r["rel_err"] < 1e-5 for r in rows)
  assert tune_skinny_matmul.triton.INT8_FLOAT_BITS
  rows = tune_skinny_matmul.main(["--smoke", "--rows", "32", "--int8", "--slots", "3", "--forms"])
  assert [r["variant"] for r in rows] == ["xla_dot", "pallas_dot_n64_rows256_bk128_w4",
                                          "pallas_dot_n64_rows256_bk128_w4_s4"]
  assert all("error" not in r and r["rel_err"] < 1e-5 for r in rows)


def test_decode_attention_probe_checks_every_config_against_the_reference(monkeypatch):
  import jax
  import probe_decode_attention
  from sparsejax.kernels.decode_attention import op
  # Test speed only: each config's kernel traced and lowered once a program, not once per layer of the probe's
  # chain (interpreted, its lowering was most of this test's time). The config is static; the program is the same.
  monkeypatch.setattr(op, "_split_kernel", jax.jit(op._split_kernel, static_argnums=5))
  report = probe_decode_attention.main(["--smoke", "--focused", "--stages", "1,2"])
  assert set(report) == {"tiny-moe_b1", "tiny-moe_b8"}
  for case in report.values():
    assert "library" in case["us"] and len(case["errs"]) >= 9
    assert any(n.endswith("_st2") for n in case["errs"]) and any("_st" not in n for n in case["errs"] if n != "library")
    assert max(case["errs"].values()) < 1e-5  # float32 on the CPU
  with pytest.raises(SystemExit, match="--stages"):
    probe_decode_attention.main(["--smoke", "--stages", "0"])


@pytest.mark.cpu_suite("it checks the probe's refusal of a CPU (on a GPU the probe runs its measurement)")
def test_pdl_probe_puts_the_grid_wait_where_it_says_and_refuses_a_cpu():
  """probe_pdl's kernels, lowered for CUDA: the wait forms carry griddepcontrol.wait, the plain one none, the
  trigger forms griddepcontrol.launch_dependents; on a CPU the probe stops with one line (its PTX cannot run here)."""
  import jax
  import jax.numpy as jnp
  import probe_pdl
  x = jax.ShapeDtypeStruct((probe_pdl.K,), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((probe_pdl.K, probe_pdl.N), jnp.bfloat16)
  for mode in probe_pdl.MODES[1:]:
    xin = jax.ShapeDtypeStruct((probe_pdl.N,), jnp.float32) if mode.endswith("_direct") else x
    text = lower_for_gpu(lambda x, w, mode=mode: probe_pdl.matvec(x, w, mode), xin, w).as_text()
    assert ("griddepcontrol.wait" in text) == (mode in ("wait_first", "prefetch")), mode
    assert ("griddepcontrol.launch_dependents" in text) == mode.startswith("trigger"), mode
  with pytest.raises(SystemExit, match="needs a GPU"):
    probe_pdl.main([])


@pytest.mark.cpu_suite("interpreted, the probe returns errors only; on a GPU it times the variants too")
def test_dataflow_ffn_probe_matches_its_reference_across_calls_and_the_counters_wrap():
  """probe_dataflow_ffn in interpret mode (programs in order, as the GPU starts them): every variant equals the
  reference within a bf16 ulp over three calls on one counter buffer and a fourth whose arrivals cross int32's
  wrap; a counter layout whose counts are not powers of two is refused in one line; the kernel lowers for CUDA."""
  import jax
  import jax.numpy as jnp
  import probe_dataflow_ffn as probe
  errs = probe.main([])
  assert set(errs) == set(probe.VARIANTS) and all(e <= 2 ** -7 for e in errs.values()), errs
  x = jnp.zeros((1, 512), jnp.bfloat16)
  args = (x, x, jnp.ones((1,)), jnp.zeros((1,), jnp.int32), jnp.zeros((1, 512, 1536), jnp.bfloat16),
          jnp.zeros((1, 1536, 512), jnp.bfloat16), 0, probe.counters(512, 1536))
  with pytest.raises(ValueError, match="powers of two"):
    probe.dataflow_ffn(*args, interpret=True)
  d, f = 1024, 4096  # medium-moe's, as the GPU run times it
  shapes = [jax.ShapeDtypeStruct(s, t) for s, t in [((1, d), jnp.bfloat16)] * 2 + [
      ((1,), jnp.float32), ((1,), jnp.int32), ((4, d, f), jnp.bfloat16), ((4, f, d), jnp.bfloat16), ((), jnp.int32),
      (probe.counters(d, f).shape, jnp.int32)]]
  text = lower_for_gpu(probe.dataflow_ffn, *shapes).as_text()
  assert text.count("xla.gpu.triton") == 1


def test_bench_decode_no_check_times_without_the_full_forward(tmp_path, monkeypatch):
  """bench_decode --no-check (timing runs): rows are timed and marked unchecked, and check_step never runs."""
  import bench_decode
  monkeypatch.setattr(bench_decode, "check_step", lambda *a: pytest.fail("checked despite --no-check"))
  res = bench_decode.main(["--presets", "tiny-dense", "--batches", "1", "--prompt-len", "8", "--warmup", "1",
                           "--steps", "2", "--reps", "1", "--chunk", "2", "--copy-mb", "4", "--copy-warmup-s", "0",
                           "--no-check", "--out-dir", str(tmp_path)])
  (row,) = res["rows"]
  assert "error" not in row and row["step_ms"] > 0 and "rel_err_vs_full_forward" not in row
  assert "| unchecked |" in bench_decode._fmt_row(row)
  assert res["sparsejax_source"] == provenance.source_fingerprint()  # which tree ran, for A/Bs
  assert res["copy_GBps"] > 0


def test_bench_decode_set_builds_a_model_outside_the_presets(tmp_path, monkeypatch):
  """--set replaces config fields in the preset (the rows timed are of that model, under --label), and a
  --set model never stands in for the preset in the issue's targets."""
  import bench_decode
  built = []
  real = bench_decode.Transformer
  monkeypatch.setattr(bench_decode, "Transformer", lambda cfg, **kw: built.append(cfg) or real(cfg, **kw))
  res = bench_decode.main(["--presets", "tiny-moe", "--batches", "1", "--prompt-len", "8", "--warmup", "1",
                           "--steps", "2", "--reps", "1", "--chunk", "2", "--copy-mb", "4", "--copy-warmup-s", "0",
                           "--no-check", "--no-int8", "--set", "num_layers=2,top_k=2,glu=true,activation=silu",
                           "--label", "tiny-glu", "--out-dir", str(tmp_path)])
  (cfg,) = built
  assert (cfg.num_layers, cfg.top_k, cfg.glu, cfg.activation, cfg.d_model) == (2, 2, True, "silu", 128)
  (row,) = res["rows"]
  assert "error" not in row and row["preset"] == "tiny-glu" and row["static_slots"] == 2
  assert res["config_set"] == dict(num_layers=2, top_k=2, glu=True, activation="silu")  # the JSON says which model
  rows = [dict(row, preset="medium-moe+set"), dict(row, preset="medium-moe")]
  assert [line.startswith("- medium MoE") for line in bench_decode.targets(rows)] == [True]


@pytest.mark.parametrize("text, message", [
    ("d_model", "key=value pairs"), ("d_modle=4", "not a TransformerConfig field"), ("num_layers=", "key=value")])
def test_bench_decode_set_rejects_bad_pairs_in_one_line(text, message):
  import bench_decode
  with pytest.raises(ValueError, match=message):
    bench_decode.parse_overrides(text)
  assert bench_decode.parse_overrides("d_model=64, glu=False,activation=relu,rope_base=5e5") == dict(
      d_model=64, glu=False, activation="relu", rope_base=5e5)


def test_bench_decode_prints_a_traced_rows_kernels_one_line_each(capsys):
  """--trace's kernel table is printed under its row, one line per part (bench_decode's log once refused print's
  sep and lost every row after the first traced one)."""
  import bench_decode
  k = dict(busy_union_ms=0.5, kernels=[("skinny_matmul", 0.25, 4.0)], run=[("skinny_matmul", 1.5, 20.0)])
  bench_decode.log(*bench_decode.kernel_lines(k), sep="\n")
  out = capsys.readouterr().out.splitlines()
  assert out == ["  kernels: union busy 0.500 ms / step; skinny_matmul 0.250 ms x4",
                 "  a run of the last step's kernels (idle us before, us): skinny_matmul 1.5 20.0"]


def test_copy_bandwidth_warms_up_then_times_windows_of_calls():
  """The copy bandwidth is timed after its warm-up, in windows of back-to-back calls synced once each (timed one
  synced call at a time, the host's dispatch and sync read as 14% less bandwidth on an H100)."""
  import bench_decode
  ticks = iter(range(10 ** 6))
  # Each reading of the clock advances it 1 s: the warm-up loop reads it once per call until 3 s have
  # passed, then each window reads it twice around its 5 calls, so a call takes 1/5 s and 40 bytes move in it.
  assert bench_decode.copy_bandwidth(20, 3.0, windows=4, calls=5, clock=lambda: float(next(ticks))) == pytest.approx(40 / 0.2)


def test_decode_report_states_each_target_only_where_the_issue_sets_it():
  """The MoE / dense line carries the issue's 0.67x target for xs at batch 1 only (the H200 report printed it beside
  small's and batch 32's ratios too); medium-moe at batch 1 gets its bound line, int8 its speed-up."""
  import bench_decode
  row = lambda p, v, b, tps, ms: {"preset": p, "variant": v, "batch": b, "tokens_per_s": tps, "step_ms": ms,
                                  "x_bound": 3.0, "bytes_all_experts": 100 if v == "bf16" else 50}
  rows = [row(p, v, b, tps, 1.0) for b in (1, 32) for p, v, tps in
          (("xs-dense", "bf16", 10.0), ("xs-moe", "bf16", 8.0), ("small-dense", "bf16", 10.0), ("small-moe", "bf16", 6.0))]
  rows += [row("medium-moe", "bf16", 1, 1.0, 1.0), row("xs-moe", "int8", 1, 9.0, 0.8)]
  lines = bench_decode.targets(rows)
  assert "- xs MoE / dense tokens/s at batch 1: 0.80 (target >= 0.67)." in lines
  assert "- xs MoE / dense tokens/s at batch 32: 0.80." in lines
  assert "- small MoE / dense tokens/s at batch 1: 0.60." in lines
  assert sum("target" in line for line in lines) == 2  # xs at batch 1 and medium-moe's bound
  assert "- medium MoE (bf16) at batch 1: 3.00x the memory bound (target <= 2x)." in lines
  assert any(line.startswith("- xs MoE int8 / float at batch 1: expert bytes 0.50x") for line in lines)


def test_source_fingerprint_tells_two_trees_apart(tmp_path):
  """The fingerprint in the benchmarks' headers: the same for a copy of the package, different once
  one byte of one file differs, and of the sparsejax that Python imported by default."""
  import shutil

  src = ROOT / "sparsejax"
  copy = tmp_path / "sparsejax"
  shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
  fp = provenance.source_fingerprint(copy)
  assert len(fp) == 12 and fp == provenance.source_fingerprint(src) == provenance.source_fingerprint()
  routing = copy / "routing.py"
  routing.write_text(routing.read_text() + "\n")
  assert provenance.source_fingerprint(copy) != fp


def test_expert_mlp_ab_traces_each_config_set_anew(monkeypatch):
  """--ab-rounds compiles every config set from a fresh trace: jit caches traces by function
  identity, and one shared function once timed the first set's program under every set's name."""
  import dataclasses

  import bench_expert_mlp_parts as parts
  import jax.numpy as jnp
  import tune_gmm

  from sparsejax.kernels.gmm import mosaic

  monkeypatch.setitem(tune_gmm.SHAPES, "tiny", (256, 128, 128, 2, 1))
  monkeypatch.setitem(parts.CONFIG_SETS, "k32", {"tgmm": dataclasses.replace(mosaic.DEFAULT_CONFIGS.tgmm, tile_k=32)})
  # Stand-ins: the products ab() needs for its operands, and a tgmm whose output is the tgmm
  # config it was traced under.
  monkeypatch.setattr(mosaic, "gmm_act", lambda a, b, topo, act: (a @ b[0], act(a @ b[0])))
  monkeypatch.setattr(mosaic, "gmm_dact", lambda a, b, topo, pre, act: a @ b[0].T)
  monkeypatch.setattr(mosaic, "tgmm", lambda a, b, topo, dtype: jnp.full((2, 2), mosaic.DEFAULT_CONFIGS.tgmm.tile_k, dtype))
  monkeypatch.setattr(parts, "timeit", lambda fn, *args: 1e-3)
  res = parts.ab("tiny", ["default", "k32"], rounds=1, names=("tgmm h^T dY",))
  assert res["same_program_as_first"] == {"tgmm h^T dY k32": False}
  assert res["rel_err_vs_first"]["tgmm h^T dY k32"][0] > 0.1
  monkeypatch.setitem(parts.CONFIG_SETS, "k32", {})  # the same configs: flagged, not timed as a difference
  assert parts.ab("tiny", ["default", "k32"], rounds=1, names=("tgmm h^T dY",))["same_program_as_first"] == {
      "tgmm h^T dY k32": True}


@pytest.mark.cpu_suite("its 'default' variant is TF32 on a GPU by design, 2e-4 from float64")
def test_router_precision_bench_checks_every_variant_against_float64(tmp_path):
  """Each algorithm the backend has is timed and checked (a float32-accurate one near 1e-7 on the CPU,
  which computes every one in float32); one it lacks is reported, not timed; the JSON is written."""
  import bench_router_precision as brp
  records = brp.main(["--smoke", "--out-dir", str(tmp_path)])
  assert {r["variant"] for r in records} == set(brp.VARIANTS)
  timed = [r for r in records if "unsupported" not in r]
  assert {"highest", "bf16_x6"} <= {r["variant"] for r in timed}
  assert all(r["ms"] > 0 and r["err_logits"] < 1e-5 and r["err_dw"] < 1e-5 for r in timed)
  (path,) = tmp_path.glob("router_precision_*.json")  # a smoke run's own name: never a measured run's results
  assert path.name == f"router_precision_{brp.jax.devices()[0].device_kind.replace(' ', '_')}_smoke.json"
  saved = json.loads(path.read_text())
  assert len(saved["records"]) == len(records) and saved["smoke"]


def test_expert_mlp_parts_times_all_six_products():
  """The parts bench's MLP fwd+bwd returns y with the gradients: a jax.grad of sum(y * ct) lets XLA
  drop the forward's last product as dead code (five of six products timed, as until 2026-11-25)."""
  import re

  import bench_expert_mlp_parts as parts
  import jax
  import jax.numpy as jnp

  f = lambda a, w1, w2: jnp.tanh(a @ w1) @ w2
  a, w1, w2, ct = jnp.ones((8, 4)), jnp.ones((4, 6)), jnp.ones((6, 4)), jnp.ones((8, 4))

  def dots(fn):
    return len(re.findall(r"\bdot\(", jax.jit(fn).lower(a, w1, w2).compile().as_text()))

  assert dots(jax.grad(lambda *x: jnp.sum(f(*x) * ct), argnums=(0, 1, 2))) == 5  # what the old timing ran
  y, grads = jax.jit(parts.fwd_bwd(f, ct))(a, w1, w2)
  assert dots(parts.fwd_bwd(f, ct)) == 6 and y.shape == (8, 4) and len(grads) == 3


def test_gmm_wave_model_counts_the_busiest_sm_and_light_tiles():
  import jax.numpy as jnp
  import numpy as np
  import probe_gmm_waves as w

  order = np.arange(7)  # step i runs on SM i % 3
  assert w.busiest_sm_load(order, np.full(7, 128), 1, 3, 0.5) == (3.0, 7 / 3)  # a last wave of one tile
  # Light blocks (1-64 real rows) cost h, inactive ones nothing: SM 0 runs tiles 0, 3, 6.
  assert w.busiest_sm_load(order, np.array([128, 64, 0, 128, 10, 0, 0]), 1, 3, 0.5) == (2.0, 1.0)
  assert list(w.reversed_waves(jnp.arange(8), 3)) == [0, 1, 2, 5, 4, 3, 6, 7]  # full waves only


@pytest.mark.cpu_suite("it checks the probe's refusal of a CPU (on a GPU the probe runs its measurement)")
def test_paired_tile_probe_matches_its_reference_in_every_mode_and_lowers(monkeypatch):
  """probe_paired_tile interpreted: full, light and paired tiles against reference(), where a light tile's
  second half is zero and a pair's multiplies the next expert's weights (so the wrong form reads far off);
  every timed variant lowers for CUDA at the probe's shapes; on a CPU the timing refuses to run."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  import mosaic_interpret_compat
  import probe_paired_tile as probe

  from sparsejax.kernels.gmm import mosaic

  mosaic_interpret_compat.install()
  mosaic_interpret_compat.compile_thread_bodies_once()
  lhs, w, he = probe.problem(3, 128, 256, 3, seed=1)  # 3 blocks x 2 column tiles over 2 "SMs"
  cfg = mosaic.Config(tile_n=128, tile_k=64, max_concurrent_steps=2, epi_tile_n=64)
  for mode in probe.MODES:
    got = probe.tile_gmm(lhs, w, he, mode=mode, cfg=cfg)
    assert probe.common.rel_err(got, probe.reference(lhs, w, he, mode)) < 1e-2, mode
    if mode != "full":
      assert probe.common.rel_err(got, probe.reference(lhs, w, he, "full")) > 0.5, mode
  with pytest.raises(ValueError, match="mode"):
    probe.tile_gmm(lhs, w, he, mode="triple", cfg=cfg)
  with pytest.raises(SystemExit, match="sm_90"):
    probe.main([])

  monkeypatch.setattr(mosaic, "_interpret", lambda: None)
  monkeypatch.setattr(mosaic, "_num_sms", lambda: 132)
  for _, k, n in probe.SHAPES:
    args = [jax.ShapeDtypeStruct(s, t) for s, t in [((probe.ROW_BLOCKS * probe.BLOCK, k), jnp.bfloat16),
                                                    ((probe.EXPERTS, k, n), jnp.bfloat16),
                                                    ((probe.ROW_BLOCKS, 2), jnp.int32)]]
    for name, mode, changes in probe.VARIANTS:
      c = probe.fitted(dataclasses.replace(mosaic.DEFAULT_CONFIGS.gmm, **changes), mode, k, n)
      text = lower_for_gpu(lambda *a, mode=mode, c=c: probe.tile_gmm(*a, mode=mode, cfg=c), *args).as_text()
      assert "mosaic_gpu" in text, name


def test_paired_tile_probe_mixed_loop_pairs_light_blocks_and_matches_the_layout(monkeypatch):
  """probe_paired_tile's mixed loop, interpreted on a hand-made layout: light blocks (1-64 real rows) pair
  up in order, the odd one and full blocks run as today's tiles, inactive blocks drop out; every form equals
  the layout's reference on the active blocks, padding rows included (the interpreter leaves unwritten rows
  NaN, so a pair's zero stores are checked); the mixed kernel lowers for CUDA at the probe's shapes."""
  import jax
  import jax.numpy as jnp
  import mosaic_interpret_compat
  import probe_paired_tile as probe

  from sparsejax.kernels.gmm import mosaic

  mosaic_interpret_compat.install()
  mosaic_interpret_compat.compile_thread_bodies_once()
  rbr = jnp.array([100, 128, 40, 30, 64, 0], jnp.int32)  # blocks 2, 3, 4 light; block 5 inactive
  rbe = jnp.array([0, 1, 1, 2, 3, 3], jnp.int32)
  ebo = jnp.array([0, 1, 3, 4, 5], jnp.int32)
  k, n = 128, 256
  keys = jax.random.split(jax.random.key(0), 2)
  lhs = jax.random.normal(keys[0], (6 * probe.BLOCK, k), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (4, k, n)) / k ** 0.5).astype(jnp.bfloat16)
  want = probe.layout_reference(lhs, w, rbe, rbr)
  cfg = mosaic.Config(tile_n=128, tile_k=64, max_concurrent_steps=2, epi_tile_n=64)
  items = {p: probe.mixed_items(rbe, rbr, ebo, n, tile_n=128, width=8, pair_n=64, paired=p) for p in (False, True)}
  assert sorted(map(tuple, items[False][:, :3].tolist())) == sorted([(0, b, b) for b in range(5)] * 2)
  pairs = items[True][items[True][:, 0] == 1]
  assert pairs[:, 1:3].tolist() == [[2, 3]] * 4 and sorted(pairs[:, 3].tolist()) == [0, 1, 2, 3]
  assert sorted(items[True][items[True][:, 0] == 0, 1].tolist()) == [0, 0, 1, 1, 4, 4]
  for paired, hoist in ((False, True), (False, False), (True, False)):
    got = probe.mixed_gmm(jnp.asarray(items[paired]), rbe, rbr, lhs, w, cfg=cfg, pair_n=64, hoist=hoist)
    assert probe.layout_error(got, want, rbr) < 1e-2, (paired, hoist)
  wrong = probe.layout_reference(lhs, w, jnp.array([0, 1, 2, 2, 3, 3], jnp.int32), rbr)  # block 2 on expert 2
  assert probe.layout_error(got, wrong, rbr) > 0.1

  monkeypatch.setattr(mosaic, "_interpret", lambda: None)
  monkeypatch.setattr(mosaic, "_num_sms", lambda: 132)
  k, n = probe.SHAPES[0][1:]
  c = probe.fitted(mosaic.DEFAULT_CONFIGS.gmm, "full", k, n)
  args = [jax.ShapeDtypeStruct(s, t) for s, t in [((640, 4), jnp.int32), ((192,), jnp.int32), ((192,), jnp.int32),
                                                  ((192 * probe.BLOCK, k), jnp.bfloat16),
                                                  ((probe.EXPERTS, k, n), jnp.bfloat16)]]
  for hoist in (False, True):
    text = lower_for_gpu(lambda *a, hoist=hoist: probe.mixed_gmm(*a, cfg=c, pair_n=c.tile_n // 2, hoist=hoist),
        *args).as_text()
    assert "mosaic_gpu" in text, hoist


def test_gmm_wave_probe_checks_each_config_set_and_refuses_unknown_ones(capsys):
  import probe_gmm_waves as w
  from peers import common

  res = w.in_mlp("smoke_skewed", ["default", "default+rev"], rounds=1, timer=common.SMOKE_TIMER, calls=1)
  assert res["rel_err"]["default+rev"] == [0.0] * 4 and len(res["ms"]["default+rev"]) == 1
  assert res["kernels"]["default"]  # device time by name (CPU events here)
  with pytest.raises(SystemExit):
    w.main(["--in-mlp", "smoke", "--configs", "default,nope"])
  assert "--configs: ['nope']" in capsys.readouterr().err


def test_results_go_to_out_once_and_never_onto_themselves(tmp_path, monkeypatch):
  """--out-dir equal to $OUT: nothing to copy (shutil.copy would raise SameFileError, which ended a
  decode bench with a traceback after its results were written); another folder: copied."""
  from out_dir import copy_to_out

  out, other = tmp_path / "out", tmp_path / "other"
  out.mkdir(), other.mkdir()
  (out / "r.json").write_text("1")
  (other / "s.json").write_text("2")
  monkeypatch.setenv("OUT", str(out))
  copy_to_out(out / "r.json", other / "s.json", other / "missing.json")
  assert (out / "s.json").read_text() == "2" and sorted(p.name for p in out.iterdir()) == ["r.json", "s.json"]
  monkeypatch.delenv("OUT")
  copy_to_out(other / "s.json")  # no $OUT: nothing happens


@pytest.mark.cpu_suite("it checks the probe's refusal of a CPU (on a GPU the probe runs its measurement)")
def test_energy_probe_reads_the_sustained_samples_and_refuses_a_cpu(capsys):
  """probe_energy: the clock and power medians leave out the first third of nvidia-smi's samples (the
  ramp to the power cap); outputs are checked on the real rows; too few samples, no shapes, or no GPU
  stop it with one line."""
  import math

  import jax.numpy as jnp
  import probe_energy

  ramp = ["1980, 300.5", "1900, 500.0"]
  held = ["1500, 695.0", "1530, 700.0", "1545, 693.0", "1500, 690.0"]
  assert probe_energy.sustained_medians(ramp + held + [""]) == (1515.0, 694.0)
  with pytest.raises(ValueError, match="too few power samples"):
    probe_energy.sustained_medians(["1500, 700.0"])
  real = jnp.asarray([True, False, True])
  want = jnp.asarray([[1.0, 2.0], [9.0, 9.0], [3.0, 4.0]])
  got = want.at[1].set(jnp.nan)  # an unspecified row (inactive block): left out of the comparison
  assert probe_energy.output_error((got, want), want, real) == 0.0
  assert probe_energy.output_error(want, want * 2, real) == 0.5
  # rows that are not the gmm rows (a cuBLAS peer's): all compared, so the NaN counts
  assert math.isnan(probe_energy.output_error(got[:2], want[:2], real))
  line = probe_energy.report("x", 2e-3, 1500.0, 700.0, 1e12)
  assert "1400.0 mJ a call" in line and "1400.0 J/PFLOP" in line and "3.000 Mcycles" in line
  with pytest.raises(SystemExit):
    probe_energy.main([])
  assert "nothing to do" in capsys.readouterr().err
  with pytest.raises(SystemExit, match="needs a GPU and nvidia-smi"):
    probe_energy.main(["--kernels", "E64_top1"])


@pytest.mark.cpu_suite("it checks the A-B's refusal of a CPU (on a GPU the A-B runs its measurement)")
def test_sustained_ab_compares_real_rows_and_refuses_bad_arguments(capsys):
  """ab_sustained: y and dx are compared on the real rows only (the rest may be unwritten), the
  weight gradients everywhere; fewer than two config sets, an unknown one or a CPU stop it in one line."""
  import jax.numpy as jnp
  import ab_sustained

  real = jnp.asarray([[True], [False]])
  y = jnp.asarray([[1.0, 2.0], [jnp.nan, 5.0]])
  dw = jnp.asarray([[1.0]])
  got = (y, (y + 1, dw + 0.5, dw))
  assert ab_sustained.max_diffs(got, (y, (y + 1, dw, dw)), real) == [0.0, 0.0, 0.5, 0.0]
  for argv in (["--configs", "default"], ["--configs", "default,nope"], ["--what", "mlp,wall"], []):
    with pytest.raises(SystemExit):
      ab_sustained.main(argv)
    assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.cpu_suite("interpreted, the probe returns errors only; on a GPU it times the variants too")
def test_slab_ffn_probe_matches_its_reference_and_lowers():
  """probe_slab_ffn in interpret mode: every one-kernel variant (each program a hidden-layer slab through both
  products) equals the reference within a bf16 ulp, the read-only ones their slabs' sums; the kernel lowers for
  CUDA at medium-moe's sizes, as the GPU run times it."""
  import jax
  import jax.numpy as jnp
  import probe_slab_ffn as probe
  errs = probe.main([])
  assert set(errs) == set(probe.VARIANTS) | {"two_kernels"} and all(e <= 2 ** -7 for e in errs.values()), errs
  shapes = [jax.ShapeDtypeStruct(s, t) for s, t in [((1, 1024), jnp.bfloat16), ((1,), jnp.int32),
                                                    ((4, 1024, 4096), jnp.bfloat16), ((4, 4096, 1024), jnp.bfloat16)]]
  text = lower_for_gpu(lambda *a: probe.slab_parts(*a, programs=128, num_warps=8), *shapes).as_text()
  assert text.count("xla.gpu.triton") == 1


@pytest.mark.host_callbacks
def test_tma_read_probe_tokens_equal_what_each_band_holds():
  """probe_tma_read in interpret mode: the TMA kernel's token is its band's first rows after the whole band
  arrived, the Triton kernel's its band's column sums; the TMA kernel lowers for CUDA at 16 MB."""
  import jax
  import jax.numpy as jnp
  import probe_tma_read as probe
  errs = probe.check(interpret=True, variants=("tma_g128", "triton_g128"))
  assert errs == {"tma_g128": 0.0, "triton_g128": 0.0}, errs
  shapes = [jax.ShapeDtypeStruct((8192, probe.D), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.float32)]
  text = lower_for_gpu(lambda w, dep: probe.tma_read(w, dep, ctas=128), *shapes).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.host_callbacks
def test_pdl_mosaic_probe_token_holds_band_and_previous_output_and_every_form_lowers():
  """probe_pdl_mosaic: the plain kernel's token in interpret mode is its band's first rows, then the previous
  kernel's token (interpret mode has no griddepcontrol); every form, with its grid-dependency calls, lowers for CUDA."""
  import jax
  import jax.numpy as jnp
  import probe_pdl_mosaic as probe
  assert probe.check(interpret=True, forms=("plain",)) == {"plain": 0.0}
  shapes = [jax.ShapeDtypeStruct((2048, probe.D), jnp.bfloat16),
            jax.ShapeDtypeStruct((128, 2, probe.TOK, probe.CHUNK), jnp.bfloat16)]
  for form in probe.FORMS:
    text = lower_for_gpu(lambda w, p, form=form: probe.step(w, p, ctas=128, form=form), *shapes).as_text()
    assert "mosaic_gpu" in text, form


@pytest.mark.cpu_suite("interpreted, the probe returns errors only; on a GPU it times the variants too")
def test_overlap_phases_probe_matches_its_reference_and_counts_every_arrival():
  """probe_overlap_phases in interpret mode: the three-kernel chain and every one-grid variant equal the reference
  over three calls on one counter and one across its int32 wrap, and each call leaves the count the next waits
  for; the one grid lowers for CUDA."""
  import jax
  import jax.numpy as jnp
  import probe_overlap_phases as probe
  errs = probe.main([])
  assert set(errs) == set(probe.VARIANTS) | {"three_kernels"} and all(e <= 2 ** -6 for e in errs.values()), errs
  shapes = [jax.ShapeDtypeStruct(s, t) for s, t in [((1, probe.D), jnp.bfloat16),
                                                    ((probe.H, probe.C, probe.R, probe.DH), jnp.bfloat16),
                                                    ((probe.D, probe.D), jnp.bfloat16), ((), jnp.int32),
                                                    ((1,), jnp.int32)]]
  text = lower_for_gpu(probe.one_kernel_parts, *shapes).as_text()
  assert text.count("xla.gpu.triton") == 1


@pytest.mark.cpu_suite("interpreted, the probe returns errors only; on a GPU it times the variants too")
def test_persistent_layer_probe_matches_its_oracle_and_every_wait_survives_to_the_kernel():
  """probe_persistent_layer in interpret mode at one program (each barrier then waits for the program itself):
  the kernel-per-phase chain and every persistent variant equal the float64 oracle over three calls on one counter
  and one across its int32 wrap, each call leaving the count the next waits for. At 128 programs every variant
  lowers for CUDA as one kernel, and each waiting variant keeps a poll loop per barrier (jax drops a loop whose
  only effects are reads unless its result is used)."""
  import jax
  import jax.numpy as jnp
  import probe_persistent_layer as probe
  errs = probe.main([])
  assert set(errs) == set(probe.VARIANTS) | {"kernels"} and all(e <= 1e-5 for e in errs.values()), errs
  P = 128
  ws = [jax.ShapeDtypeStruct((P, probe.PHASES[i][1], probe.D), jnp.bfloat16) for i in probe.HEAVY]
  args = (jax.ShapeDtypeStruct((probe.D,), jnp.float32), ws, jax.ShapeDtypeStruct((), jnp.int32),
          jax.ShapeDtypeStruct((1,), jnp.int32))
  for name, (poll, early, wait) in probe.VARIANTS.items():
    fn = functools.partial(probe.layer_persistent, poll=poll, early=early, wait=wait)
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    assert jaxpr.count("while[") == (len(probe.PHASES) - 1 if wait else 0), name
    assert jaxpr.count("probe_prefetch_l2") == (2 if early == "l2" else 0), name  # the attention's and W_o's slabs
    text = lower_for_gpu(fn, *args).as_text()
    assert text.count("xla.gpu.triton") == 1, name


@pytest.mark.cpu_suite("it checks the probe's refusal of a CPU (on a GPU the probe runs its measurement)")
def test_persistent_layer_mgpu_probe_lowers_every_variant_and_refuses_a_cpu():
  """probe_persistent_layer_mgpu's grid barriers cannot run in interpret mode (blocks run one after another, and it
  has no global semaphores): on the CPU the probe refuses in one line, the variant without grid barriers is
  interpreted (its TMA copies land where the phases wait for them; one barrier per phase, an arrival a copy), and
  each variant lowers for CUDA as one Mosaic GPU kernel whose grid barriers are present only where it has them."""
  import jax
  import jax.numpy as jnp
  import probe_persistent_layer_mgpu as probe
  with pytest.raises(SystemExit, match="needs a GPU"):
    probe.main([])
  # every copy lands where the phases wait for it, in the layer kernel and across the layers of the step kernel
  assert probe.check(("nobarrier", "step_nobarrier"), num=2) == {"nobarrier": 0.0, "step_nobarrier": 0.0}
  slabs = [jax.ShapeDtypeStruct((128, probe.ROWS[i], probe.COLS), jnp.bfloat16) for i in probe.HEAVY]
  dep = jax.ShapeDtypeStruct((8, probe.COLS), jnp.bfloat16)
  for name, (early, scope) in probe.VARIANTS.items():
    fn = functools.partial(probe.layer_mgpu, early=early, scope=scope, interpret=False)
    jaxpr = str(jax.make_jaxpr(fn)(dep, slabs))
    waits = len(probe.PHASES) - 1 if scope else 0
    signal = "probe_semaphore_signal_gpu" if scope == "gpu" else "semaphore_signal"
    assert jaxpr.count("semaphore_wait") == waits and jaxpr.count(signal) == waits, name
    text = lower_for_gpu(fn, dep, slabs).as_text()
    assert text.count("probe_persistent_layer_mgpu") >= 1, name
  stacked = [jax.ShapeDtypeStruct((3, *s.shape), s.dtype) for s in slabs]
  for name, (prefetch_next, scope) in probe.STEP_VARIANTS.items():
    fn = functools.partial(probe.step_mgpu, prefetch_next=prefetch_next, scope=scope, interpret=False)
    jaxpr = str(jax.make_jaxpr(fn)(dep, stacked))
    assert jaxpr.count("semaphore_wait") == (3 * len(probe.PHASES) - 1 if scope else 0), name
    lower_for_gpu(fn, dep, stacked)


def test_chain_timing_harness_compares_times_and_traces_chains(tmp_path, capsys):
  """chain_timing on two tiny jitted chains: every chain runs before the timing, a chain whose output differs is
  reported by how much (unless skipped), each round times both, and the trace prints each chain's kernels."""
  import jax
  import jax.numpy as jnp
  import chain_timing
  fns = {"base": jax.jit(lambda x: x * 2.0), "other": jax.jit(lambda x: x * 2.0 + 1.0),
         "skipped": jax.jit(lambda x: -x)}
  args_of = dict.fromkeys(fns, (jnp.ones((64,)),))
  chain_timing.compare_outputs(fns, args_of, "base", "a chain", skip=lambda n: n == "skipped")
  times = chain_timing.time_interleaved(fns, args_of, 3, calls=10)
  assert {n: len(t) for n, t in times.items()} == {"base": 3, "other": 3, "skipped": 3}
  assert all(v > 0 for t in times.values() for v in t)
  chain_timing.print_times(times, "base", "a call")
  chain_timing.print_trace({"base": fns["base"]}, args_of, str(tmp_path), calls=1, unit="a call")
  out = capsys.readouterr().out
  assert "other: a chain, max |diff| from base 1" in out and "skipped: a chain" not in out
  assert "1.00x base" in out and "base: device busy" in out


@pytest.mark.parametrize("case", ["overlap_one_grid", "dataflow_ffn"])
def test_one_grid_probes_put_a_cta_barrier_before_each_counting_atomic(case, tmp_path):
  """triton_sass's TTIR of the one-grid probes: every atomic that adds one (a program counting itself in, after its
  stores) follows a gpu.barrier since the last atomic, so no thread's store can trail the release."""
  import triton_sass
  (path,) = triton_sass.main([case, "--out", str(tmp_path)])
  lines = open(path).read().splitlines()
  counting, barrier_since = 0, False
  for line in lines:
    if "gpu.barrier" in line:
      barrier_since = True
    elif "tt.atomic_rmw add" in line:
      if "%c1_i32" in line:  # adds one: a program counting itself in (the waits add zero)
        counting += 1
        assert barrier_since, f"{case}: a counting atomic without a barrier before it: {line.strip()}"
      barrier_since = False
  assert counting >= 1


def test_triton_sass_int8_cases_lower_the_loop_k_major_and_n_major(tmp_path):
  """triton_sass's int8 cases: the library's 32-row dot loop over k-major int8 (the dot takes the weight tile
  transposed: a tt.trans of the loaded [n, k] tile) and the probe's n-major loop (no transpose), each an int8 load
  feeding the dot through a cast."""
  import triton_sass
  texts = {case: open(triton_sass.main([case, "--out", str(tmp_path)])[0]).read()
           for case in ("skinny_int8", "int8_n_major")}
  for text in texts.values():
    assert "tt.dot" in text and "tensor<128x128x!tt.ptr<i8>>" in text and "arith.sitofp" in text
  assert "tt.trans" in texts["skinny_int8"] and "tt.trans" not in texts["int8_n_major"]


def test_triton_sass_row_ffn_cases_lower_the_slab_width_they_name():
  """triton_sass's row FFN cases: each int8 case's program loads a W_in slab of its width's rows of W_in^T (k-major),
  64 bytes too though they make fewer programs than a wave, bf16's 32 columns of W_in; tracing a case leaves the
  library's widths as they were."""
  import triton_sass
  from sparsejax.kernels.skinny_matmul import triton_row_ffn as row
  widths = row.SLAB_ROW_BYTES_INT8, row.SLAB_ROW_BYTES, row.WAVE_PROGRAMS
  for case, tile in [("row_ffn_int8_16", "16x1024xi8"), ("row_ffn_int8_32", "32x1024xi8"),
                     ("row_ffn_int8_64", "64x1024xi8"), ("row_ffn_bf16", "1024x32xbf16")]:
    fn, shapes = triton_sass.CASES[case]()
    (text,) = triton_sass.ttir_of(fn, *shapes)
    assert f"tensor<{tile}>" in text, case
  assert (row.SLAB_ROW_BYTES_INT8, row.SLAB_ROW_BYTES, row.WAVE_PROGRAMS) == widths


def test_probe_bench_check_times_decoders_compiled_before_and_after_the_check(capsys):
  """probe_bench_check: A is timed before and after bench_decode's check, B (and with --copy C) after it; each
  label has its rounds' times and the report prints the check's error."""
  import probe_bench_check
  times = probe_bench_check.main(["--preset", "tiny-moe", "--prompt-len", "8", "--steps", "2", "--rounds", "2",
                                  "--copy"])
  assert sorted(times) == ["A after the check", "A before the check", "B after the check", "C after the check"]
  assert all(len(v) == 2 and all(t > 0 for t in v) for v in times.values())
  assert "check rel err" in capsys.readouterr().out


def test_ab_decode_traces_b_under_its_patch_and_a_without(capsys):
  """ab_decode: B's Decoder is traced while its patch is in place and A's is not (each has jitted steps of its
  own); the run prints both variants, their ratio and (--trace) each one's kernel table; a malformed patch fails
  with one line."""
  import ab_decode
  from sparsejax.models import transformer
  real, calls = transformer.decode_attention, []

  def recording(*a, **kw):
    calls.append(1)
    return real(*a, **kw)

  res = ab_decode.main(["--preset", "tiny-dense", "--prompt-len", "8", "--steps", "2", "--rounds", "2", "--trace"])
  assert res["differ"] == 0.0 and len(res["ratios"]) == 2 and all(r > 0 for r in res["ratios"])
  out = capsys.readouterr().out
  assert "no patch (A-A)" in out and "B's traced call" in out and set(res["kernels"]) == {"A", "B"}
  import jax
  from flax import nnx
  from sparsejax.models import Transformer, get_preset
  model = Transformer(get_preset("tiny-dense"), rngs=nnx.Rngs(0))
  prompt = jax.numpy.ones((1, 8), jax.numpy.int32)
  ab_decode.new_decoder(model, 1, 16, prompt)  # A: the same model's step, compiled without the patch
  with ab_decode.patched([("sparsejax.models.transformer", "decode_attention", recording)]):
    ab_decode.new_decoder(model, 1, 16, prompt)
  # B traced afresh under the patch (A's compiled step was not reused), and the patch undone after
  assert calls and transformer.decode_attention is real
  assert ab_decode.parse_patch("a.b:c=const:False")[2](1, x=2) is False
  assert ab_decode.parse_patch("a.b:c=64") == ("a.b", "c", 64)
  for bad in ("a.b=1", "a.b:c=not a literal"):
    with pytest.raises(SystemExit, match="--patch"):
      ab_decode.parse_patch(bad)
  with pytest.raises(SystemExit, match="has no attribute 'nope'"):
    with ab_decode.patched([("sparsejax.models.transformer", "nope", 1)]):
      pass
  res = ab_decode.main(["--preset", "tiny-moe", "--int8", "--glu", "--prompt-len", "8", "--steps", "2", "--rounds", "2",
                        "--set", "num_layers=2,top_k=2"])
  assert res["differ"] == 0.0 and "tiny-moe GLU [num_layers=2,top_k=2] (int8 experts)" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="--int8: the model has no MoE layer"):
    ab_decode.main(["--preset", "tiny-dense", "--int8", "--prompt-len", "8", "--steps", "2", "--rounds", "2"])


@pytest.mark.cpu_suite("it checks the probe's refusal of a CPU (on a GPU the probe runs its measurement)")
def test_row_moves_probe_checks_every_gather_variant_and_keeps_the_unmasked_peer_off_the_cpu(tmp_path):
  """probe_row_moves interpreted on its tiny shape: each gather variant, repeated, bit-equal to XLA's; the
  pre-883519e kernel (a timing peer that only a GPU runs) refused in one line off the GPU."""
  import probe_row_moves
  out = probe_row_moves.main(["--shapes", "tiny", "--configs", "64x128", "--repeats", "2", "--out", str(tmp_path)])
  gathers = [r["variant"] for r in out if r["move"].startswith("gather")]
  assert gathers == ["xla #1", "triton_64x128 #1", "xla #2", "triton_64x128 #2"]
  assert all(r["rel_err"] == 0 and r["ms"] > 0 for r in out) and len(out) == 7
  assert json.loads((tmp_path / "row_moves_probe.json").read_text()) == out
  with pytest.raises(SystemExit):
    probe_row_moves.main(["--shapes", "tiny", "--unmasked", "--out", str(tmp_path)])


@pytest.mark.cpu_suite("it checks the probe's refusal of a CPU (on a GPU the probe runs its measurement)")
def test_megakernel_skeleton_probe_refuses_a_cpu():
  """On the CPU the probe refuses in one line: its grid barriers cannot be interpreted."""
  import probe_megakernel_skeleton as probe
  with pytest.raises(SystemExit, match="needs a GPU"):
    probe.main([])


def test_megakernel_skeleton_probe_reference_and_lowering():
  """probe_megakernel_skeleton: its reference equals a loop written out for one CTA (the window's sum, the product's
  rounding and scale, the expert's data-dependent slab); every variant lowers for CUDA as one Mosaic GPU kernel with
  a grid barrier after each phase but the last exactly where it has barriers."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import probe_megakernel_skeleton as probe
  with pytest.raises(SystemExit):  # argparse's one-line error for a variant it does not have
    probe.main(["--variants", "fulll"])
  num, W = 128, probe.W
  # The inputs and the reference, jitted: op by op, their many small ops compiled one program each.
  dep, qkv, att, w_o, exp = jax.jit(probe.inputs, static_argnums=(1, 2))(jax.random.key(3), num, 1)
  reference = jax.jit(probe.reference, static_argnames="reads")
  f32 = lambda x: np.asarray(x, np.float32).astype(np.float64)  # on the host, as the casts below
  bf = lambda x: f32(np.asarray(x, np.float32).astype(jnp.bfloat16))
  slabs = {"qkv": np.asarray(qkv), "attention": np.asarray(att), "w_o": np.asarray(w_o), "expert": np.asarray(exp)}
  for reads in ("window", "row", 8, None):
    got = np.asarray(reference(dep, qkv, att, w_o, exp, reads=reads), np.float64)
    p = 70  # in the second window
    def v_of(prev):
      if reads == "window":
        return prev[64:128].sum(0) * 0.125
      if reads == "row":
        return prev[(p + 1) % num]
      if reads == 8:
        total = sum(prev[(p + j) % num] for j in range(1, 9))
        return total / np.sqrt(np.mean(total ** 2) + 1e-6)
      return ((np.arange(W) % 7) - 3) * 0.25
    prev = f32(dep)
    for k, (name, chunks) in enumerate(probe.PHASES):
      v = v_of(prev)
      def product(slab, first, n, v):
        a = f32(slab)[first * W:(first + n) * W].reshape(n, W, W)
        return np.einsum("cmk,k->m", a, bf(v)) / np.sqrt(W * n)
      if name == "expert":
        slab = slabs["expert"][0, int(v.sum() > 0), p]
        want = product(slab, chunks // 2, chunks // 2, product(slab, 0, chunks // 2, v))
      elif chunks:
        want = product(slabs[name][0, p], 0, chunks, v)
      else:
        want = v * probe.LIGHT_SCALE[reads]
      np.testing.assert_allclose(got[k, p], want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=f"{reads} {name}")
      prev = got[k]  # the other CTAs' outputs, from the reference itself
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (dep, qkv, att, w_o, exp)]
  for name, flags in probe.VARIANTS.items():
    fn = lambda *a, flags=flags: probe.step(*a, **flags)
    jaxpr = str(jax.make_jaxpr(fn)(*shapes))
    waits = len(probe.PHASES) - 1 if flags["barriers"] else 0
    assert jaxpr.count("semaphore_wait") == waits and jaxpr.count("probe_semaphore_signal_gpu") == waits, name
    assert ("wgmma" in jaxpr) == flags["mma"], name
    text = lower_for_gpu(fn, *shapes).as_text()
    assert "probe_megakernel_skeleton" in text, name


@pytest.mark.cpu_suite("it checks the probe's refusal of a CPU (on a GPU the probe runs its measurement)")
def test_int8_weight_layout_probe_matches_the_product_in_every_form_and_lowers():
  """probe_int8_weight_layout interpreted: each layout and conversion equals the float32 product (a k-major read of
  an n-major weight does not), every variant of the timed run passes its check, the kernels lower for CUDA at the
  probe's shapes, and the probe refuses a bad layout and a CPU timing run."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import probe_int8_weight_layout as probe

  m, k, n = 20, 256, 256  # rows padded to 32 by the probe, as by the library
  x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
  q = jax.random.randint(jax.random.key(1), (3, k, n), -127, 128, jnp.int32).astype(jnp.int8)
  ids = jnp.array([2, 0], jnp.int32)
  want = np.einsum("mk,skn->smn", np.asarray(x, np.float32), np.asarray(q, np.float32)[np.asarray(ids)])
  fns = probe.variants(m, k, n, 2, interpret=True)
  for name in ("int8_n_major_cast", "int8_n_major_bits", "int8_k_major_cast", "int8_k_major_bits"):
    f, kind = fns[name]
    got = np.asarray(f(x, jnp.swapaxes(q, 1, 2) if kind == "int8_k_major" else q, ids))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5, name
  got = np.asarray(fns["int8_k_major_cast"][0](x, q, ids))  # the n-major weight read as k-major: its transpose
  assert np.abs(got - want).max() / np.abs(want).max() > 0.5
  rows = probe.run([(256, 256)], 32, 2, chain=1)
  assert len(rows) == 7 and not [r for r in rows if "error" in r] and all(r["rel_err"] < 1e-4 for r in rows)
  with pytest.raises(ValueError, match="layout"):
    probe.product_parts(x, q, ids, layout="m_major", float_bits=False, cfg=probe.dot_config(m, k, n, 2))
  with pytest.raises(SystemExit, match="GPU"):
    probe.main([])
  for pk, pn in probe.SHAPES:
    cfg = probe.dot_config(32, pk, pn, 22)
    for layout in probe.LAYOUTS:
      w = jax.ShapeDtypeStruct((22, pn, pk) if layout == "k_major" else (22, pk, pn), jnp.int8)
      text = lower_for_gpu(lambda x, w, ids, layout=layout: probe.product_parts(
          x, w, ids, layout=layout, float_bits=False, cfg=cfg),
          jax.ShapeDtypeStruct((32, pk), jnp.bfloat16), w, jax.ShapeDtypeStruct((22,), jnp.int32)).as_text()
      assert "probe_int8_weight_layout" in text, layout


def test_cub_sorts_probe_checks_every_variant_equal_to_the_librarys(tmp_path):
  """probe_cub_sorts on the CPU: each tried sort gives the library's ranks, rounding and layer outputs."""
  import probe_cub_sorts
  records = probe_cub_sorts.main(["--smoke", "--reps", "2", "--rounds", "1", "--out", str(tmp_path)])
  parts = {r["part"] for r in records}
  assert parts == {"ranks", "rounding", "layers"}
  for r in records:
    assert r.get("equal", True) and r.get("equal_to_first_of_kind", True), r
    assert r.get("check_ok", True) and r.get("grads_finite", True), r
  assert len([r for r in records if r["part"] == "layers"]) == len(probe_cub_sorts.LAYER_VARIANTS)
  assert (tmp_path / f"cub_sorts_probe_{probe_cub_sorts.jax.devices()[0].device_kind.replace(' ', '_')}.json").exists()


def test_cub_sorts_probe_restores_the_librarys_sorts_and_refuses_bad_variants():
  import probe_cub_sorts
  from sparsejax import permute
  from sparsejax.kernels.block_rounding import op, reference
  before = (permute._ranks, reference.ranks_within, op.runs_kernel)
  with pytest.raises(RuntimeError):
    with probe_cub_sorts.library_ranks(probe_cub_sorts.unsigned_argsort_ranks, probe_cub_sorts.two_pass_rounding_ranks):
      assert reference.ranks_within is probe_cub_sorts.two_pass_rounding_ranks and not op.runs_kernel("auto")
      raise RuntimeError("a variant failed")
  assert (permute._ranks, reference.ranks_within, op.runs_kernel) == before
  for bad in ("dropless_histogram,nonesuch", "rounded_two_key_sort"):
    with pytest.raises(SystemExit, match="--layer-variants"):
      probe_cub_sorts.main(["--smoke", "--layer-variants", bad])


def test_recv_placement_probe_checks_every_variant_against_the_argsort(tmp_path):
  """probe_recv_placement --smoke: the received ids read NO_EXPERT past each peer's rows, every variant's rows and
  group sizes equal the argsort placement's, and each compiled program is saved beside the JSON."""
  import numpy as np
  import probe_recv_placement as probe
  meta, sent = probe.inputs(2, 16, 3, 8, 0.25)
  ids = np.asarray(probe.received_ids(meta[:, 0], sent[:, 0], 3)).reshape(2, 16, 3)
  assert (ids[0] >= 0).all() and (ids[1, :4] >= 0).all() and (ids[1, 4:] == -1).all()
  assert all(len(set(row)) == 3 for row in ids[0])  # distinct experts a token, as merge_repeats leaves them
  records = probe.main(["--smoke", "--out", str(tmp_path)])
  assert [r["variant"] for r in records] == list(probe.VARIANTS)
  assert all(r["equal_to_argsort"] and r["median_ms"] > 0 and r["devices"] == 1 for r in records), records
  dev = probe.jax.devices()[0].device_kind.replace(" ", "_")
  assert json.loads((tmp_path / f"recv_placement_probe_{dev}.json").read_text())["records"] == records
  assert len(list(tmp_path.glob("recv_placement_*.hlo.txt"))) == len(probe.VARIANTS)
  for bad in (["--variants", "in_jit,nonesuch"], ["--variants", "exchanged"]):  # the second needs --gpus
    with pytest.raises(SystemExit):
      probe.main(["--smoke", *bad])


@pytest.mark.devices(2)
def test_recv_placement_probe_exchanged_places_what_each_device_receives(tmp_path):
  """probe_recv_placement --gpus 2 on two host devices: after the dense all-to-all each device's placement equals
  the argsort placement of the blocks the other devices sent it."""
  import probe_recv_placement as probe
  records = probe.main(["--smoke", "--gpus", "2", "--variants", "exchanged,exchanged_barrier,in_jit",
                        "--out", str(tmp_path)])
  assert [(r["variant"], r["devices"]) for r in records] == [("exchanged", 2), ("exchanged_barrier", 2), ("in_jit", 1)]
  assert all(r["equal_to_argsort"] for r in records), records
  dev = probe.jax.devices()[0].device_kind.replace(" ", "_")
  assert (tmp_path / f"recv_placement_probe_{dev}_x2.json").exists()


def test_rounding_group_probe_checks_each_variant(tmp_path):
  """probe_rounding_group on the CPU: the vmapped group rounding equals round_to_blocks on the shards joined."""
  import probe_rounding_group
  records = probe_rounding_group.main(["--smoke", "--shapes", "smoke", "--groups", "1,4", "--out", str(tmp_path)])
  measured = {"routing", "alone", "group", "alone_kernel", "group_kernel", "nth_kernel", "nth_sort"}
  assert {r["variant"] for r in records} == measured | {"one_device", "one_device_kernel"}
  assert all(r["check_ok"] for r in records) and len(records) == 2 * len(measured) + 4
  assert (tmp_path / f"rounding_group_probe_{probe_rounding_group.jax.devices()[0].device_kind.replace(' ', '_')}.json").exists()


@pytest.mark.devices(2)
def test_rounding_ep_layer_probe_checks_each_variant(tmp_path):
  """probe_rounding_ep_layer on the CPU, two host devices: the expert-parallel rounded layer, its moves either way,
  equals the single-device rounded layer on the joined tokens, the dropless one the single-device dropless layer,
  and the sort's patch is undone."""
  import probe_rounding_ep_layer
  from sparsejax.kernels.block_rounding import op
  before = op.runs_kernel
  records = probe_rounding_ep_layer.main(["--smoke", "--gpus", "2", "--rounds", "1", "--out", str(tmp_path)])
  assert op.runs_kernel is before
  assert [r["variant"] for r in records] == ["ep_kernel", "ep_sort", "ep_dropless", "single", "single_dropless"]
  assert [r["devices_used"] for r in records] == [2, 2, 2, 1, 1]
  assert all(r["check_ok"] for r in records) and records[0]["num_dropped"] > 0
  assert records[2]["num_dropped"] == 0
  dev = probe_rounding_ep_layer.jax.devices()[0].device_kind.replace(" ", "_")
  assert (tmp_path / f"rounding_ep_layer_probe_{dev}_x2_smoke.json").exists()
