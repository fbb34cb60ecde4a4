"""python -m sparsejax.info: each "auto" choice as the library makes it, on the CPU and, with the GPU's generation
set, on a T4, an RTX 4090-class card and an H100."""
import re
import subprocess
import sys

import jax
import pytest

from sparsejax import info, kernels
from sparsejax.kernels.gmm import op as gmm_op


def test_on_the_cpu_it_runs_as_a_module_and_prints_xla_everywhere():
  out = subprocess.run([sys.executable, "-m", "sparsejax.info"], capture_output=True, text=True, check=True).stdout
  rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines())
  assert rows["device"] == "cpu: cpu" and rows["compute capability"] == "-"
  assert rows["MoE experts, bfloat16"] == rows["MoE experts, float32"] == "ragged_dot"
  assert rows["attention, bfloat16"] == "xla" and rows["decode kernels"] == "xla"


@pytest.mark.parametrize("cc,want", [
    ("7.5", {"MoE experts, bfloat16": "ragged_dot", "MoE experts, float32": "ragged_dot", "attention, bfloat16": "xla",
             "router's float32 dots": "HIGHEST", "decode kernels": "xla"}),
    ("8.9", {"MoE experts, bfloat16": "pallas (triton)", "MoE experts, float32": "pallas (triton)",
             "attention, bfloat16": "cudnn", "router's float32 dots": "BF16_BF16_F32_X6", "decode kernels": "triton",
             "Triton gmm / tgmm tiles, bfloat16": "gmm 128 x 256 x 64, 2 stages; tgmm 128 x 64, 2 stages",
             "shared memory a block": "99 KiB"}),
    ("9.0", {"MoE experts, bfloat16": "pallas (mosaic)", "MoE experts, float32": "pallas (triton)",
             "attention, bfloat16": "cudnn", "router's float32 dots": "BF16_BF16_F32_X6", "decode kernels": "triton",
             "Triton gmm / tgmm tiles, bfloat16": "gmm 128 x 256 x 64, 3 stages; tgmm 128 x 256, 2 stages",
             "shared memory a block": "227 KiB"}),
])
def test_each_gpu_generation_gets_its_choices(monkeypatch, cc, want):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  for module, name in ((kernels, "gpu_compute_capability"), (gmm_op, "_gpu_compute_capability")):
    monkeypatch.setattr(module, name, lambda: cc)
  kernels._warn_before_ampere.cache_clear()
  got = info.choices()
  assert got["compute capability"] == cc
  dots = "router's float32 dots"
  assert {k: got.get(k) for k in want if k != dots} == {k: v for k, v in want.items() if k != dots}
  assert want[dots] in got[dots]
  warned = [v for k, v in got.items() if k.startswith("warning")]
  assert (len(warned) == 1 and "predates sm_80" in warned[0]) if cc == "7.5" else not warned, warned
