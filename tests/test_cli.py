"""The command line: each user error is one line on stderr and exit status 2, raised before anything is
compiled or written; --help shows every option's default without importing jax."""
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsejax import cli
from sparsejax import train as loop
from sparsejax.checkpoint import Checkpointer
from sparsejax.models import PRESETS, get_preset
from sparsejax.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def text(tmp_path):
  path = tmp_path / "text.txt"
  path.write_text("experts route tokens; tokens reach experts. " * 50)
  return str(path)


@pytest.fixture
def no_training(monkeypatch):
  """Fails the test if the command gets as far as the loop (which builds and compiles the model)."""
  def run(*args, **kwargs):
    raise AssertionError("the command reached the training loop")
  monkeypatch.setattr(loop, "run", run)


def _fails(argv, out, capsys, match):
  with pytest.raises(SystemExit) as e:
    cli.main([*argv, "--out", str(out), "--no-progress"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("sparsejax-train: error: "), err  # one line, no traceback
  assert match in err, err
  assert not out.exists()  # no empty run folder left behind
  return err


BAD = [
    (["--steps", "0"], "--steps must be an integer >= 1; got 0"),
    (["--steps", "-5"], "--steps must be an integer >= 1; got -5"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--batch-size", "-2"], "--batch-size must be an integer >= 1"),
    (["--seq-len", "0"], "--seq-len must be an integer >= 1"),
    (["--seq-len", "1.5"], "argument --seq-len: invalid int value"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--lr=-1e-3"], "--lr must be a finite number > 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--lr", "fast"], "argument --lr: invalid float value"),
    (["--warmup", "-1"], "--warmup must be an integer >= 0"),
    (["--eval-batches", "0"], "--eval-batches must be an integer >= 1"),
    (["--dtype", "float64"], "--dtype must be one of float32, bfloat16, float16"),
    (["--adam-mu-dtype", "float16"], "--adam-mu-dtype must be one of float32, bfloat16"),
    (["--grad-accum", "0"], "--grad-accum must be an integer >= 1; got 0"),
    (["--batch-size", "6", "--grad-accum", "4"], "--batch-size 6 does not split into --grad-accum 4 microbatches"),
    (["--max-time-s", "0"], "--max-time-s must be a finite number > 0"),
    (["--set", "capacity_factor"], "expected FIELD=VALUE"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--preset", "huge"], "Unknown preset 'huge'"),
    (["--preset", "tiny-mo"], "Did you mean 'tiny-moe'?"),
    (["--set", "not_a_field=3"], "--set not_a_field: not a TransformerConfig field"),
    (["--set", "d_model=abc"], "d_model must be a positive int"),
    (["--set", "capacity_factor=-1"], "capacity_factor must be > 0"),
    (["--set", "glu=yes"], "TransformerConfig.glu must be True or False; got 'yes'"),  # a truthy string
    (["--preset", "tiny-dense", "--set", "renormalize=no"], "TransformerConfig.renormalize must be True or False"),
    (["--set", "rope_base=0"], "TransformerConfig.rope_base must be a finite number > 0; got 0"),
    (["--preset", "tiny-dense", "--set", "num_experts=0"], "TransformerConfig.num_experts must be a positive int"),
    (["--set", "vocab_size=10"], "vocab_size=10 is smaller than the byte-level corpus"),
]


@pytest.mark.parametrize("argv,match", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments(argv, match, tmp_path, text, capsys, no_training):
  _fails([*argv, "--data", text], tmp_path / "run", capsys, match)


def test_bad_data(tmp_path, text, capsys, no_training):
  out = tmp_path / "run"
  _fails(["--data", str(tmp_path / "missing.txt")], out, capsys, "does not exist")
  (tmp_path / "empty.txt").write_text("")
  _fails(["--data", str(tmp_path / "empty.txt")], out, capsys, "is empty")
  (tmp_path / "no_text").mkdir()
  _fails(["--data", str(tmp_path / "no_text")], out, capsys, "holds no text files")
  (tmp_path / "odd.bin").write_bytes(b"abc")
  _fails(["--data", str(tmp_path / "odd.bin")], out, capsys, "odd number of bytes")
  _fails(["--data", text, "--seq-len", "3000"], out, capsys, "--seq-len 3000 is too long for the data")
  _fails(["--data", text, "--upcycle-from", str(tmp_path / "nowhere")], out, capsys, "no such run folder")
  (tmp_path / "a_file").write_text("x")
  _fails(["--data", text], tmp_path / "a_file" / "run", capsys, "is a file, not a folder")


def test_set_reads_json_and_pythons_true_false_none():
  """--set glu=False is False, not the truthy string "False"; JSON's spellings still work."""
  cfg = cli.parse_args(["--set", "glu=False", "--set", "renormalize=True", "--set", "capacity_factor=None",
                        "--set", "token_rounding=false", "--set", "top_k=2", "--set", "activation=silu"])
  assert cfg.model_overrides == dict(glu=False, renormalize=True, capacity_factor=None, token_rounding=False,
                                     top_k=2, activation="silu")
  assert cfg.model_config().glu is False
  assert cli._parse_value("null") is None and cli._parse_value("false") is False
  assert cli._parse_value("FALSE") == "FALSE"  # exactly Python's spellings: anything else stays a string
  assert "True/False/None" in next(a.help for a in cli.build_parser()._actions if "--set" in a.option_strings)


def test_float16_on_the_cpu_is_one_line(tmp_path, text, capsys, no_training, monkeypatch):
  """XLA:CPU cannot compile float16 attention: refused before compiling; other backends keep float16."""
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  _fails(["--dtype", "float16", "--data", text], tmp_path / "run", capsys,
         "--dtype float16 is not supported on the CPU backend: pass --dtype bfloat16 or float32.")
  _fails(["--set", "dtype=float16", "--data", text], tmp_path / "run", capsys, "not supported on the CPU backend")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  plan = loop.prepare(cli.parse_args(["--dtype", "float16", "--data", text, "--out", str(tmp_path / "run")]))
  assert plan.model_cfg.dtype == "float16"


def test_vocab_size_against_the_data(tmp_path, text, capsys, no_training):
  """A .bin with ids >= vocab_size is refused (it trains to NaN); text needs 256 ids, a larger vocab_size stays."""
  (np.arange(3000) % 300).astype(np.uint16).tofile(tmp_path / "tok.bin")
  _fails(["--data", str(tmp_path / "tok.bin"), "--set", "vocab_size=100"], tmp_path / "run", capsys,
         "holds token id 299, not below vocab_size=100")
  parse = lambda *argv: loop.prepare(cli.parse_args([*argv, "--out", str(tmp_path / "run")]))
  assert parse("--data", str(tmp_path / "tok.bin")).model_cfg.vocab_size == 320  # sized from the data
  assert parse("--data", str(tmp_path / "tok.bin"), "--set", "vocab_size=300").model_cfg.vocab_size == 300
  assert parse("--data", text).model_cfg.vocab_size == 256
  assert parse("--data", text, "--set", "vocab_size=512").model_cfg.vocab_size == 512


def test_mesh_over_more_devices_than_visible(tmp_path, text, capsys, no_training, monkeypatch):
  monkeypatch.setattr(jax, "device_count", lambda: 1)
  _fails(["--mesh", "data=2", "--data", text], tmp_path / "run", capsys, "needs 2 devices; 1 is visible.")


def test_binary_data_needs_allow_binary(tmp_path, capsys, no_training):
  blob = tmp_path / "weights.pt"
  blob.write_bytes(bytes(range(256)) * 40)
  _fails(["--data", str(blob)], tmp_path / "run", capsys, "looks binary, not text; pass --allow-binary")
  folder = tmp_path / "mixed"
  folder.mkdir()
  (folder / "a.txt").write_text("plain text " * 100)
  (folder / "program").write_bytes(b"\x7fELF\x00\x01" * 500)
  _fails(["--data", str(folder)], tmp_path / "run", capsys, "program' looks binary")
  plan = loop.prepare(cli.parse_args(["--data", str(blob), "--allow-binary", "--out", str(tmp_path / "run")]))
  assert len(plan.corpus.train) + len(plan.corpus.val) == 256 * 40
  # Text in other encodings is text: UTF-8 with multi-byte characters, and Latin-1.
  (tmp_path / "utf8.txt").write_text("déjà vu, naïve café — 専門家 " * 40, encoding="utf-8")
  (tmp_path / "latin1.txt").write_text("déjà vu, naïve café " * 40, encoding="latin-1")
  for name in ("utf8.txt", "latin1.txt"):
    loop.prepare(cli.parse_args(["--data", str(tmp_path / name), "--out", str(tmp_path / "run")]))
  assert not (tmp_path / "run").exists()


def test_an_existing_run_of_another_model_is_one_line(tmp_path, text, capsys, no_training):
  """A run folder whose checkpoint holds another config: the message names the differing fields only."""
  out = tmp_path / "run"
  other = get_preset("tiny-moe", d_model=64, num_experts=4, dtype="float32")
  ckpt = Checkpointer(out / "checkpoints")
  ckpt.save(3, {"params": {"w": jnp.zeros(2)}}, {"step": 3, "model_config": other.to_dict()}, force=True)
  ckpt.close()
  with pytest.raises(SystemExit) as e:
    cli.main(["--preset", "tiny-moe", "--data", text, "--out", str(out)])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "holds a run of another model" in err, err
  assert "d_model 64 there, 128 now" in err and "num_experts 4 there, 8 now" in err
  assert "num_layers" not in err and "rope_base" not in err  # equal fields are not listed
  # The same model resumes (prepare finds the step; the loop then prints "resumed from step 3").
  plan = loop.prepare(cli.parse_args(["--preset", "tiny-moe", "--set", "d_model=64", "--set", "num_experts=4",
                                      "--data", text, "--out", str(out), "--dtype", "float32"]))
  assert plan.resume_step == 3


def test_a_run_resumes_with_other_remat_or_backends_and_from_before_remat_existed(tmp_path, text, no_training):
  """remat and the backends say how the model runs, not what it is: a run resumes with other values of them, and a
  checkpoint written before the remat field existed (its config lacks it) resumes as the same model."""
  out = tmp_path / "run"
  saved = cli.parse_args(["--data", text, "--out", str(out)]).model_config().to_dict()
  del saved["remat"]
  ckpt = Checkpointer(out / "checkpoints")
  ckpt.save(3, {"params": {"w": jnp.zeros(2)}}, {"step": 3, "model_config": {**saved, "moe_impl": "xla"}}, force=True)
  ckpt.close()
  for extra in ([], ["--set", "remat=block"], ["--set", "remat=ffn", "--set", "attention_impl=xla"]):
    assert loop.prepare(cli.parse_args(["--data", text, "--out", str(out), *extra])).resume_step == 3, extra


def test_a_model_whose_state_cannot_fit_is_one_line_before_anything_is_built(tmp_path, text, capsys, monkeypatch,
                                                                            no_training):
  """Where the devices report free memory (a GPU; stubbed here) and the parameters with AdamW's moments exceed it, the
  command stops with one line and its hints, before building the model (the allocator may retry for minutes)."""
  monkeypatch.setattr(loop, "free_device_bytes", lambda devices: 2**20)
  monkeypatch.setattr(loop, "build_model", lambda *a, **kw: pytest.fail("built the model"))
  with pytest.raises(SystemExit) as e:
    cli.main(["--data", text, "--out", str(tmp_path / "run"), "--no-progress"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count("\n") == 1 and "AdamW's moments need" in err, err
  assert "--adam-mu-dtype bfloat16" in err and not (tmp_path / "run").exists()
  # The bytes, by hand: tiny-moe's two MoE layers hold 2 x 8 x 128 x 512 expert parameters each; float32 params,
  # second and first moments take 12 bytes a parameter, 10 with a bf16 first moment, the experts' split by --mesh.
  # The rest: embedding and head 2 x 256 x 128, per block qkv 128 x 384, out 128 x 128 and two norms of 128, two dense
  # FFNs 2 x 128 x 512, two routers 128 x 8, the final norm.
  cfg = TrainConfig()
  experts = 2 * 2 * 8 * 128 * 512
  rest = 2 * 256 * 128 + 4 * (128 * 384 + 128 * 128 + 2 * 128) + 2 * 2 * 128 * 512 + 2 * 128 * 8 + 128
  full = loop.state_bytes_per_device(cfg, cfg.model_config())
  assert full == 12 * (experts + rest)
  assert loop.state_bytes_per_device(TrainConfig(adam_mu_dtype="bfloat16"), cfg.model_config()) == full // 12 * 10
  assert loop.state_bytes_per_device(TrainConfig(mesh="expert=8"), cfg.model_config()) == full - 12 * experts * 7 // 8


def test_an_existing_run_is_checked_whatever_ckpt_every_says_and_on_its_data(tmp_path, text, capsys, no_training):
  """--ckpt-every 0 once skipped the check, so another model trained over the run; other --data is refused too."""
  out = tmp_path / "run"
  tiny = cli.parse_args(["--data", text, "--out", str(out)])
  ckpt = Checkpointer(out / "checkpoints")
  meta = {"step": 3, "model_config": tiny.model_config().to_dict(), "corpus": text}
  ckpt.save(3, {"params": {"w": jnp.zeros(2)}}, meta, force=True)
  ckpt.close()
  with pytest.raises(SystemExit):
    cli.main(["--preset", "tiny-dense", "--ckpt-every", "0", "--data", text, "--out", str(out)])
  assert "holds a run of another model" in capsys.readouterr().err
  assert loop.prepare(cli.parse_args(["--ckpt-every", "0", "--data", text, "--out", str(out)])).resume_step == 3
  other = tmp_path / "other.txt"
  other.write_text("other words for the experts. " * 80)
  with pytest.raises(SystemExit):
    cli.main(["--data", str(other), "--out", str(out)])
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "holds a run on other data" in err and "--data it was started with" in err, err
  # The same file spelled another way is the same data.
  rel = os.path.relpath(text)
  assert loop.prepare(cli.parse_args(["--data", rel, "--out", str(out)])).resume_step == 3


def test_help_lists_every_preset_and_default():
  assert set(cli.PRESET_NAMES) == set(PRESETS)
  parser = cli.build_parser()
  for action in parser._actions:
    if action.option_strings != ["-h", "--help"]:
      assert "(default: " in action.help, action.option_strings


def test_help_does_not_import_jax():
  """`sparsejax-train --help` (and parsing arguments) answers without importing jax: fast, even on a bad line."""
  code = ("import sys\n"
          "from sparsejax import cli\n"
          "cfg = cli.parse_args(['--steps', '7', '--preset', 'tiny-dense'])\n"
          "assert cfg.steps == 7\n"
          "try:\n"
          "  cli.main(['--help'])\n"
          "except SystemExit as e:\n"
          "  assert e.code == 0\n"
          "print('JAX IMPORTED' if 'jax' in sys.modules else 'NO JAX')\n")
  env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "120"}
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip().endswith("NO JAX"), r.stdout
  text = " ".join(r.stdout.split())  # whatever the line wrapping
  assert "usage: sparsejax-train" in text and "--batch-size BATCH_SIZE sequences per step" in text
  assert f"(default: {TrainConfig().steps})" in text and "(default: the Python standard library's sources)" in text


def test_lazy_package_keeps_the_flat_api():
  """sparsejax imports its public names on use; a submodule import never shadows a public function."""
  import sparsejax
  import sparsejax.grouped_matmul  # noqa: F401  (binds nothing over the function of the same name)
  assert callable(sparsejax.grouped_matmul) and sparsejax.grouped_matmul.__module__ == "sparsejax.grouped_matmul"
  for name in sparsejax.__all__:
    assert getattr(sparsejax, name) is not None, name
  assert set(sparsejax.__all__) <= set(dir(sparsejax))
  assert sparsejax.routing.top_k_routing is sparsejax.top_k_routing  # submodules as attributes, as before
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    sparsejax.nope  # noqa: B018
