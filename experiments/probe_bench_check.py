"""Whether bench_decode's medium-moe step runs slower in a process that first ran its check against the full forward.

Measured on an H100 (results/decode_bench_spread_H100.log): bench_decode.py --presets medium-moe --batches 1 read
0.877-0.899 ms a step with its check and 0.798-0.811 without, one process each, the same code. This probe splits the
candidates in one process: A is a Decoder compiled before the check, B one compiled after it, C one compiled after
it on a copy of the weights made then. A timed before and after the check tells a change of the process's runtime
state (allocator, the weights' buffers) from one of what was compiled (XLA's in-process autotuning cache); B and C
tell the compile from the weights' placement.

What it found (0.797 / 0.799 for A, 0.810 for B) and the twenty-eighth session's runs with autotuning dumped and
off (results/decode_bench_autotune_H100.log) say the check is not the cause: bench processes of one code spread by
up to 8% with or without it.

  python experiments/probe_bench_check.py --preset medium-moe
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ab_decode import new_decoder  # noqa: E402
from bench_decode import check_step  # noqa: E402
from sparsejax.models import Transformer, get_preset  # noqa: E402


def timed(dec, tok, steps: int) -> tuple[float, jax.Array]:
  t0 = time.perf_counter()
  _, tok = dec.run_buffer(tok, steps)
  tok.block_until_ready()
  return 1e3 * (time.perf_counter() - t0) / steps, tok


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="medium-moe")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--check-len", type=int, default=16)
  ap.add_argument("--steps", type=int, default=32)
  ap.add_argument("--rounds", type=int, default=6)
  ap.add_argument("--copy", action="store_true", help="also C (medium-moe's weights twice do not fit an 80 GB card "
                  "beside A's and the check's)")
  args = ap.parse_args(argv)
  cfg = get_preset(args.preset, dtype=args.dtype, param_dtype=args.dtype)
  slots = args.prompt_len + 3 + (4 * args.rounds + 2) * args.steps
  model = Transformer(cfg.replace(max_seq_len=max(cfg.max_seq_len, slots)), rngs=nnx.Rngs(0))
  prompt = jax.random.randint(jax.random.key(0), (1, args.prompt_len), 1, cfg.vocab_size)
  decs, toks, times = {}, {}, {}

  def rounds(names, label):
    for n in names:
      times.setdefault(f"{n} {label}", [])
    for r in range(args.rounds):
      for n in names if r % 2 == 0 else names[::-1]:
        t, toks[n] = timed(decs[n], toks[n], args.steps)
        times[f"{n} {label}"].append(t)

  decs["A"], toks["A"] = new_decoder(model, 1, slots, prompt)
  rounds(["A"], "before the check")
  check_prompt = jax.random.randint(jax.random.key(1), (1, args.check_len), 1, cfg.vocab_size)
  rel, _ = check_step(model, check_prompt)
  decs["B"], toks["B"] = new_decoder(model, 1, slots, prompt)
  if args.copy:
    copy = nnx.merge(*jax.tree.map(jnp.copy, nnx.split(model)))
    decs["C"], toks["C"] = new_decoder(copy, 1, slots, prompt)
  rounds(["A", "B", "C"] if args.copy else ["A", "B"], "after the check")
  print(f"{args.preset} batch 1 on {jax.devices()[0].device_kind}, {args.rounds} rounds of {args.steps} steps; "
        f"check rel err {rel:.1e}. A: compiled before the check; B: after it"
        + ("; C: after it, on a copy of the weights" if args.copy else ""))
  for k, v in times.items():
    print(f"  {k}: {statistics.median(v):.4f} ms a step (range {min(v):.4f}-{max(v):.4f})")
  return times


if __name__ == "__main__":
  main()
