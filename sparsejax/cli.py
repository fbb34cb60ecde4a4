"""`sparsejax-train`: train a Transformer LM from the command line (`sparsejax-train --help`).

Arguments are parsed and checked before jax is imported, and every user error (a bad value, an
unknown preset, missing or binary data, an --out holding another model's run) ends the command
with one line on stderr and exit status 2, before anything is compiled or written.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from sparsejax.train_config import COMPUTE_DTYPES, TrainConfig

PROG = "sparsejax-train"
# Listed here rather than read from sparsejax.models.PRESETS, which imports jax (a test keeps them equal).
PRESET_NAMES = ("tiny", "tiny-dense", "tiny-moe", "xs-dense", "xs-moe", "small-dense", "small-moe",
                "medium-dense", "medium-moe")

HELP = {
    "preset": f"model preset: {', '.join(PRESET_NAMES)} (tiny = tiny-moe)",
    "data": "a text file, a folder of text files, a uint16 .bin of token ids, 'stdlib' or 'site-packages'",
    "out": "run folder for metrics.jsonl and checkpoints/; a run already there is resumed",
    "steps": "number of training steps",
    "batch_size": "sequences per step (per optimizer update; with --grad-accum, split into microbatches)",
    "grad_accum": "gradient accumulation: run each step's batch (and each validation batch) as this many "
                  "microbatches, one after another, and update once with their mean gradient (the batch of a "
                  "larger run in the memory of a smaller one)",
    "seq_len": "tokens per sequence",
    "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "the cosine decay ends at this fraction of --lr",
    "warmup": "linear warm-up steps",
    "weight_decay": "AdamW weight decay of matrices (norm scales are not decayed)",
    "grad_clip": "clip the global gradient norm to this",
    "adam_mu_dtype": "dtype of AdamW's first moment: float32 or bfloat16 (saves 4 of the ~28 bytes per "
                     "parameter an MoE's optimizer moves each step; the second moment stays float32)",
    "seed": "seed of the initialization, the batches and the router jitter",
    "dtype": f"compute dtype: {', '.join(COMPUTE_DTYPES)} (float16 trains with dynamic loss scaling)",
    "eval_every": "evaluate every this many steps (0: only at the end)",
    "eval_every_s": "also evaluate every this many seconds of training",
    "eval_batches": "validation batches per evaluation",
    "ckpt_every": "checkpoint every this many steps (0: no checkpoints)",
    "keep": "checkpoints kept",
    "log_every": "log train metrics every this many steps",
    "max_time_s": "stop after this many seconds of training (compile and evaluation excluded)",
    "upcycle_from": ("a dense run folder to sparse-upcycle into --preset (its MoE twin; renormalized combine "
                     "weights unless --set renormalize=...)"),
    "peak_flops": "peak FLOP/s of one device, for MFU",
    "allow_binary": "accept a --data file that does not look like text",
    "mesh": "expert parallelism, e.g. data=2,expert=4: experts and their optimizer state sharded over "
            "'expert', batches over data x expert devices, the rest replicated; data=2,expert_group=2,expert=2: "
            "experts over expert_group x expert with a two-stage all-to-all (groups = hosts); fewer experts "
            "than 'expert' devices split each expert's d_ff (expert slicing)",
    "ep_buffer_factor": ("with --mesh: size the expert-parallel exchange buffers at this many times the mean "
                         "rows (e.g. 1.5); a step whose routing does not fit reruns the exchange with the safe "
                         "buffers, exactly. The safe buffers hold every routing and grow with the expert "
                         "devices, so they cost the most memory"),
}
# What a None default means, for the help text.
NONE_MEANS = {"data": "the Python standard library's sources", "dtype": "bfloat16 on GPU/TPU, float32 on CPU",
              "eval_every_s": "off", "max_time_s": "no limit", "upcycle_from": "off",
              "peak_flops": "looked up from the device kind; none for CPUs",
              "mesh": "one device", "ep_buffer_factor": "the safe buffers"}


class _Parser(argparse.ArgumentParser):
  def error(self, message: str):
    """One line (argparse's default prints the whole usage first)."""
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog=PROG, description="Train a Transformer language model (dense or MoE) on byte-level text.",
              epilog="Example: sparsejax-train --preset tiny --out runs/tiny")
  defaults = TrainConfig()
  for f in dataclasses.fields(TrainConfig):
    if f.name in ("model_overrides", "progress"):
      continue
    flag, default = "--" + f.name.replace("_", "-"), getattr(defaults, f.name)
    shown = NONE_MEANS.get(f.name, "None") if default is None else default
    help_text = f"{HELP[f.name]} (default: {shown})".replace("%", "%%")
    if isinstance(default, bool):
      p.add_argument(flag, action="store_true", help=help_text)
      continue
    kind = {"int": int, "float": float}.get(str(f.type).split("|")[0].strip(), str)  # "float | None" -> float
    p.add_argument(flag, type=kind, default=default, metavar=f.name.upper(), help=help_text)
  p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                 help="override a TransformerConfig field, repeatable, e.g. --set capacity_factor=1.25, or "
                      "--set remat=ffn (the backward recomputes the feed-forwards: less activation memory; remat=hidden "
                      "recomputes their hidden layers only: less time, more memory); VALUE is "
                      "JSON (true/false/null, numbers, strings) or Python's True/False/None (default: none)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar, logs only (default: a progress bar)")
  return p


# Python's spellings too: otherwise "False" falls through to the string "False", which is truthy.
PYTHON_LITERALS = {"True": True, "False": False, "None": None}


def _parse_value(text: str) -> Any:
  if text in PYTHON_LITERALS:
    return PYTHON_LITERALS[text]
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text  # a bare string such as bfloat16


def parse_overrides(items: list[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
  """--set's FIELD=VALUE items as a dict; a malformed one ends the command with parser.error (one line). Whether
  FIELD exists is checked with the model config."""
  overrides = {}
  for item in items:
    name, sep, value = item.partition("=")
    if not sep or not name.isidentifier():
      parser.error(f"--set {item!r}: expected FIELD=VALUE, FIELD a TransformerConfig field")
    overrides[name] = _parse_value(value)
  return overrides


def parse_args(argv=None) -> TrainConfig:
  """The TrainConfig of a command line; a bad one exits with one line on stderr (status 2)."""
  p = build_parser()
  a = p.parse_args(argv)
  overrides = parse_overrides(a.set, p)
  fields = {f.name for f in dataclasses.fields(TrainConfig)} & set(vars(a))
  try:
    return TrainConfig(**{k: getattr(a, k) for k in fields}, model_overrides=overrides, progress=not a.no_progress)
  except ValueError as e:
    p.error(str(e))


def _fail(error: Exception):
  message = " ".join(str(error).split())  # one line whatever the exception's text
  print(f"{PROG}: error: {message}", file=sys.stderr)
  raise SystemExit(2)


def main(argv=None) -> None:
  cfg = parse_args(argv)
  from sparsejax import train as loop  # jax is imported here, after the arguments are known to be good
  try:
    plan = loop.prepare(cfg)
  except (ValueError, TypeError, OSError) as e:  # what prepare raises for a user's mistake
    _fail(e)
  from sparsejax.checkpoint import CheckpointError
  try:
    loop.run(plan)
  except (CheckpointError, loop.StepDoesNotFit) as e:  # damaged checkpoint files; a step larger than the GPUs
    _fail(e)


if __name__ == "__main__":
  main()
