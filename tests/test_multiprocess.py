"""Several processes on jax.distributed: two real `sparsejax-train` processes on this machine (a local
coordinator, gloo collectives on the CPU, 2 host devices each) train the same losses as one process
with the whole batch, and their checkpoint (each process writing its own expert shards) resumes on one
device; each process reads only its own rows of the data."""
import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from sparsejax.data import BatchStream, eval_batches
from sparsejax.distributed import initialize_from_env
from sparsejax.train import TrainConfig, train
from corpus_testing import write_corpus

pytestmark = pytest.mark.cpu_suite("its processes hold CPU host devices and talk over gloo")

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(d_model=32, num_layers=1, num_heads=2, d_ff=64, num_experts=8, moe_every=1, max_seq_len=16)
ARGS = ["--preset", "tiny-moe", "--steps", "3", "--batch-size", "8", "--seq-len", "16", "--warmup", "2",
        "--eval-every", "0", "--eval-batches", "1", "--ckpt-every", "3", "--log-every", "1", "--no-progress",
        "--dtype", "float32"] + [a for k, v in TINY.items() for a in ("--set", f"{k}={v}")]


def _corpus(tmp_path):
  return write_corpus(tmp_path)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _records(out):
  return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _launch(tmp_path, extra, processes=2, devices=2, timeout=90):
  """Start `processes` CLI processes (plain launch: JAX_* variables) and wait for all; on a failure
  or a timeout the others are killed and every process's output is shown."""
  port = _free_port()
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
  procs = []
  for i in range(processes):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_PROCESSES": str(processes), "JAX_PROCESS_ID": str(i),
           "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
           "XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs.append(subprocess.Popen([sys.executable, "-m", "sparsejax.cli", *ARGS, *extra], env=env, cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outputs = [None] * processes
  try:
    for i, p in enumerate(procs):
      outputs[i] = p.communicate(timeout=timeout)[0]
  except subprocess.TimeoutExpired:
    pass
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  failed = [i for i, p in enumerate(procs) if p.returncode != 0]
  assert not failed, "\n".join(f"--- process {i} (status {procs[i].returncode}):\n{(outputs[i] or '')[-3000:]}"
                               for i in failed)
  return outputs


def test_two_processes_train_as_one(tmp_path):
  """--mesh data=2,expert=2 over 2 processes x 2 devices (experts exchanged across processes): the
  train and validation losses of one process with the whole batch on one device; only process 0
  writes metrics (each step logged once) and prints. Their step-3 checkpoint (each process writes
  its own expert shards) resumes on one device into the steps 4 and 5 of the one process trained
  straight on: step 4 checks the params and the data position, step 5 the optimizer state.
  (--warmup 2: the learning rates of updates 1..3 do not depend on --steps.)"""
  data = _corpus(tmp_path)
  two = tmp_path / "two"
  outputs = _launch(tmp_path, ["--data", data, "--out", str(two), "--mesh", "data=2,expert=2"])
  common = dict(preset="tiny-moe", data=data, batch_size=8, seq_len=16, warmup=2, eval_batches=1, log_every=1,
                progress=False, dtype="float32", model_overrides=TINY)
  one = train(TrainConfig(**common, out=str(tmp_path / "one"), steps=5, eval_every=3, ckpt_every=0))
  got = _records(two)
  want = _records(tmp_path / "one")
  train_losses = lambda records: [r["loss"] for r in records if r["kind"] == "train"]
  assert [r["step"] for r in got if r["kind"] == "train"] == [1, 2, 3]
  np.testing.assert_allclose(train_losses(got), train_losses(want)[:3], rtol=2e-5)
  np.testing.assert_allclose(got[-1]["val_loss"], [r["val_loss"] for r in want if r["kind"] == "val"][0], rtol=2e-5)
  assert "done: step 3" in outputs[0] and "done:" not in outputs[1]
  # Only finished steps (orbax also saves a run's first step): no temporary folder of an unfinished write.
  names = [p.name for p in (two / "checkpoints").iterdir()]
  assert all(n.isdigit() for n in names) and max(map(int, names)) == 3, names
  resumed = train(TrainConfig(**common, out=str(two), steps=5, eval_every=0, ckpt_every=3))
  got = _records(two)
  assert [r["step"] for r in got if r["kind"] == "train"] == [1, 2, 3, 4, 5]  # resumed, not started over
  np.testing.assert_allclose(train_losses(got)[3:], train_losses(want)[3:], rtol=2e-5)
  np.testing.assert_allclose(resumed["val_loss"], one["val_loss"], rtol=2e-5)


def test_each_process_reads_its_own_rows():
  """Processes' rows are disjoint and together the one-process batch, for training and validation."""
  tokens = np.arange(500, dtype=np.uint16)
  whole = BatchStream(tokens, 8, 16, seed=3).batch(5)
  parts = [BatchStream(tokens, 8, 16, seed=3, process_index=i, process_count=4).batch(5) for i in range(4)]
  for k in range(2):
    np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])
  whole = eval_batches(tokens, 8, 16, 2)
  parts = [eval_batches(tokens, 8, 16, 2, process_index=i, process_count=2) for i in range(2)]
  for b in range(2):
    np.testing.assert_array_equal(np.concatenate([p[b][0] for p in parts]), whole[b][0])
  with pytest.raises(ValueError, match="batch size 8 does not split over 3 processes"):
    BatchStream(tokens, 8, 16, process_index=0, process_count=3)


@pytest.mark.parametrize("env, error", [
    ({"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two': expected an integer >= 1"),
    ({"JAX_NUM_PROCESSES": "2"}, "JAX_PROCESS_ID='': expected an integer >= 0"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "JAX_PROCESS_ID=2 must be below JAX_NUM_PROCESSES=2"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "JAX_COORDINATOR_ADDRESS='': expected host:port"),
])
def test_a_bad_environment_is_one_line(env, error):
  with pytest.raises(ValueError, match=error):
    initialize_from_env(env)


@pytest.mark.parametrize("env", [{}, {"JAX_NUM_PROCESSES": "1"}, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1",
                                                                   "SLURM_STEP_NODELIST": "n1"}])
def test_one_process_starts_nothing(env):
  assert initialize_from_env(env) is False
