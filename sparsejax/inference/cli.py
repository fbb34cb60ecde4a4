"""`sparsejax-generate --run runs/tiny --prompt "def " --max-new-tokens 200`: sample from a trained run.

Loads the latest (or --step) checkpoint of a `sparsejax-train` run folder (its config JSON and
orbax params), prints the prompt and the sampled continuation (bytes decoded with errors='replace'),
then one line with the decode speed. Errors: one line on stderr, exit status 1 (2 for bad arguments).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

PROG = "sparsejax-generate"


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, not usage + message
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
  # Each help states its default in words: argparse's own formatter prints "(default: None)".
  p = _Parser(prog=PROG, description=__doc__.splitlines()[0])
  p.add_argument("--run", required=True, help="run folder of sparsejax-train (holds checkpoints/); required")
  p.add_argument("--prompt", default="\n", help="text to continue, its UTF-8 bytes the tokens (default: a newline)")
  p.add_argument("--max-new-tokens", type=int, default=200, help="tokens sampled after the prompt (default: 200)")
  p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, 0 = greedy (default: 0.8)")
  p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: all)")
  p.add_argument("--top-p", type=float, default=None,
                 help="sample among the likeliest tokens holding this probability (default: 1, all)")
  p.add_argument("--num-samples", type=int, default=1,
                 help="samples of the prompt, decoded as one batch (default: 1)")
  p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  p.add_argument("--int8", action="store_true", help="int8 weight-only experts (MoE models) (default: off)")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="compute dtype (default: the run's)")
  return p


def parse_args(argv=None) -> argparse.Namespace:
  p = build_parser()
  a = p.parse_args(argv)
  if a.max_new_tokens < 1:
    p.error(f"--max-new-tokens must be >= 1; got {a.max_new_tokens}.")
  if not a.temperature >= 0:
    p.error(f"--temperature must be >= 0; got {a.temperature}.")
  if a.top_k is not None and a.top_k < 1:
    p.error(f"--top-k must be >= 1; got {a.top_k}.")
  if a.top_p is not None and not 0 < a.top_p <= 1:
    p.error(f"--top-p must lie in (0, 1]; got {a.top_p}.")
  if a.num_samples < 1:
    p.error(f"--num-samples must be >= 1; got {a.num_samples}.")
  if not a.prompt:
    p.error("--prompt is empty: give at least one character to continue.")
  return a


def checkpoint_dir(run: str) -> pathlib.Path:
  """run/checkpoints (or run itself when it is the checkpoints folder); errors name what is missing."""
  path = pathlib.Path(run)
  if not path.is_dir():
    raise FileNotFoundError(f"no run folder at {str(path)!r}.")
  ckpt = path / "checkpoints" if (path / "checkpoints").is_dir() else path
  if not any(c.name.isdigit() for c in ckpt.iterdir()):
    raise FileNotFoundError(f"no checkpoint in {str(ckpt)!r}: train the run first (sparsejax-train --out {run}).")
  return ckpt


def load_model(run: str, *, step: int | None = None, dtype: str | None = None):
  """(model, meta) of a run's checkpoint; params restored straight into the model's abstract shapes."""
  from flax import nnx

  from sparsejax.checkpoint import Checkpointer
  from sparsejax.models import Transformer, TransformerConfig

  ckpt = Checkpointer(checkpoint_dir(run))
  try:
    if step is not None and step not in ckpt.all_steps():
      raise FileNotFoundError(f"no checkpoint of step {step} in {run!r}; steps: {ckpt.all_steps()}.")
    meta = ckpt.restore_meta(step)
    cfg = TransformerConfig.from_dict(meta["model_config"])
    if dtype is not None:
      cfg = cfg.replace(dtype=dtype)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    items, meta = ckpt.restore({"params": nnx.to_pure_dict(state)}, step)
  finally:
    ckpt.close()
  nnx.replace_by_pure_dict(state, items["params"])
  return nnx.merge(graphdef, state), meta


def run(a: argparse.Namespace) -> None:
  import jax
  import numpy as np

  from sparsejax.inference.generate import generate_timed
  from sparsejax.inference.quantize import quantize_model

  model, meta = load_model(a.run, step=a.step, dtype=a.dtype)
  if a.int8:
    model = quantize_model(model)
  prompt = list(a.prompt.encode("utf-8"))
  g = generate_timed(model, [prompt] * a.num_samples, a.max_new_tokens, temperature=a.temperature,
                     top_k=a.top_k, top_p=a.top_p, rng=jax.random.key(a.seed))
  byte_level = model.cfg.vocab_size == 256
  for i, row in enumerate(g.tokens):
    if a.num_samples > 1:
      print(f"--- sample {i}")
    text = bytes(row.astype(np.uint8).tolist()).decode("utf-8", errors="replace") if byte_level else str(row.tolist())
    print(a.prompt + text, flush=True)
  rate = g.decode_tokens_per_s
  speed = f"{rate:,.1f} tokens/s" if rate == rate else "n/a tokens/s (fewer than 3 new tokens)"
  print(f"--- {g.tokens.size} tokens from step {meta['step']}: {speed} while decoding "
        f"(batch {g.tokens.shape[0]}, {jax.devices()[0].platform}; prefill {g.prefill_s:.2f} s and first step "
        f"{g.first_step_s:.2f} s, with compilation)")


def main(argv=None) -> None:
  a = parse_args(argv)  # before importing jax: --help and bad arguments answer at once
  from sparsejax.checkpoint import CheckpointError
  try:
    run(a)
  except (FileNotFoundError, ValueError, TypeError, NotImplementedError, CheckpointError) as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  main()
