"""A decode step's A-B in one process: the same model decoded by two Decoders, B traced with patched library code,
their device loops timed interleaved.

Between processes bench_decode's medium-moe step spread 0.804-0.911 ms on identical code (notes_decode.md,
twenty-sixth session). That is more than the 1-3% a kernel change is worth, so a step-level A-B run as one process
per tree could not resolve one. Here both variants share a process, the model's weights and the GPU's state. B's
Decoder is traced while --patch replaces module attributes (a constant, a dispatch flag, or with `const:` a
function that returns a constant, such as a runs_kernel). Its jitted functions are its own: the decoders' cache of
compiled steps is cleared between them. A patch must act where the step is traced (a dispatch choice, a config
read by the caller): a kernel under shared_lowering is a nested jit that A and B share wherever their static
arguments and shapes agree, so a value read only inside its trace keeps A's, except the module switches that
shared_lowering keys on (shared_lowering.module_switches: launch_dependents.EARLY,
skinny_matmul.triton.INT8_FLOAT_BITS, triton_row_ffn.SLAB_ROW_BYTES{,_INT8}, NUM_WARPS, WAVE_PROGRAMS and
MIN_SLAB_COLUMNS). Rounds alternate the order (A B, B A, ...). Each time is one device-loop call of --steps
steps. The report gives each variant's median ms a step, and B / A's median over the rounds with its range.
Both decode the same greedy tokens from the same prompt, and the fraction that differ is printed (a kernel may
flip a near-tie). --int8 decodes both with int8 experts.

Measured on an H100 (results/decode_ab_in_process_H100.log, medium-moe at batch 1, 16 rounds): an A-A run read
B / A 1.002 (A 0.8265, B 0.8285 ms a step); with decode_qkv's kernel off (XLA's three kernels of glue) 1.010,
its rounds 0.997-1.052. The one-kernel row FFN against the split form (runs_row_ffn patched to False):
1.025 and 1.017 on medium-moe (results/decode_row_ffn_ab_in_process_H100.log).

  python experiments/ab_decode.py --preset medium-moe --patch sparsejax.models.transformer:qkv_runs_kernel=const:False
  python experiments/ab_decode.py --preset medium-moe           # no patch: an A-A run, the method's own resolution
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import os
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsejax.inference import Decoder, Sampling, quantize_model  # noqa: E402
from sparsejax.models import Transformer, get_preset  # noqa: E402

_COMPILED = importlib.import_module("sparsejax.inference.generate")  # the module (the package exports generate())


def parse_patch(text: str) -> tuple[str, str, object]:
  """'pkg.module:attr=value' -> (module, attr, value): value a Python literal, or `const:<literal>` for a function
  of any arguments that returns the literal. Bad forms fail with one line."""
  try:
    target, value = text.split("=", 1)
    module, attr = target.split(":", 1)
  except ValueError:
    raise SystemExit(f"--patch {text!r}: expected pkg.module:attr=value") from None
  const = value.startswith("const:")
  try:
    literal = ast.literal_eval(value[len("const:"):] if const else value)
  except (ValueError, SyntaxError):
    raise SystemExit(f"--patch {text!r}: the value must be a Python literal (or const:<literal>)") from None
  return module, attr, (lambda *a, **k: literal) if const else literal


@contextlib.contextmanager
def patched(patches):
  """The patches applied (each attribute must exist), undone on exit."""
  saved = []
  try:
    for module, attr, value in patches:
      mod = importlib.import_module(module)
      if not hasattr(mod, attr):
        raise SystemExit(f"--patch: {module} has no attribute {attr!r}")
      saved.append((mod, attr, getattr(mod, attr)))
      setattr(mod, attr, value)
    yield
  finally:
    for mod, attr, old in reversed(saved):
      setattr(mod, attr, old)


def new_decoder(model, batch: int, slots: int, prompt):
  """A Decoder with jitted functions of its own, its prefill run and its device loop (the one timed) compiled."""
  _COMPILED._compiled_step.cache_clear()
  _COMPILED._compiled_loop.cache_clear()
  dec = Decoder(model, batch, slots, Sampling(0.0))
  tok = dec(prompt)
  _, tok = dec.run_buffer(tok, 1)
  return dec, tok.block_until_ready()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="medium-moe")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--int8", action="store_true", help="both variants decode with int8 experts (quantize_model)")
  ap.add_argument("--glu", action="store_true", help="the preset with gated feed-forwards (glu=True, d_ff as set)")
  ap.add_argument("--set", default="", help="TransformerConfig fields to replace, key=value[,key=value] (as "
                  "bench_decode's --set): a model shape outside the presets")
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--steps", type=int, default=32, help="steps in one timed device-loop call")
  ap.add_argument("--rounds", type=int, default=12)
  ap.add_argument("--patch", action="append", default=[], help="pkg.module:attr=value for B (repeatable)")
  ap.add_argument("--trace", action="store_true", help="after the rounds, trace one call of each: kernel time per "
                  "step by kind and a run of a step's kernels (one by one with XLA_FLAGS=--xla_gpu_enable_command_buffer=)")
  args = ap.parse_args(argv)
  patches = [parse_patch(p) for p in args.patch]
  from bench_decode import parse_overrides
  try:
    overrides = parse_overrides(args.set)
  except ValueError as e:
    ap.error(str(e))
  cfg = get_preset(args.preset, dtype=args.dtype, param_dtype=args.dtype,
                   **({"glu": True} if args.glu else {}), **overrides)
  slots = args.prompt_len + 3 + (args.rounds + 1 + args.trace) * args.steps  # and one traced call
  model = Transformer(cfg.replace(max_seq_len=max(cfg.max_seq_len, slots)), rngs=nnx.Rngs(0))
  if args.int8:
    try:
      model = quantize_model(model)
    except ValueError as e:  # a dense preset has no experts to quantize
      raise SystemExit(f"--int8: {e}") from None
  prompt = jax.random.randint(jax.random.key(0), (args.batch, args.prompt_len), 1, cfg.vocab_size)
  dec_a, tok_a = new_decoder(model, args.batch, slots, prompt)
  with patched(patches):
    dec_b, tok_b = new_decoder(model, args.batch, slots, prompt)
  decs, toks = {"A": dec_a, "B": dec_b}, {"A": tok_a, "B": tok_b}
  # one untimed call each (warm-up), whose tokens are compared
  bufs = {}
  for n in decs:
    bufs[n], toks[n] = decs[n].run_buffer(toks[n], args.steps)
  differ = float(np.mean(np.asarray(bufs["A"])[:, :args.steps] != np.asarray(bufs["B"])[:, :args.steps]))
  times = {"A": [], "B": []}
  for r in range(args.rounds):
    for n in ("A", "B") if r % 2 == 0 else ("B", "A"):
      t0 = time.perf_counter()
      _, toks[n] = decs[n].run_buffer(toks[n], args.steps)
      toks[n].block_until_ready()
      times[n].append(1e3 * (time.perf_counter() - t0) / args.steps)
  ratios = [b / a for a, b in zip(times["A"], times["B"])]
  name = (args.preset + (" GLU" if args.glu else "") + (f" [{args.set}]" if overrides else "")
          + (" (int8 experts)" if args.int8 else ""))
  print(f"{name} batch {args.batch}, {args.rounds} rounds of {args.steps} steps on "
        f"{jax.devices()[0].device_kind}; B: {', '.join(args.patch) or 'no patch (A-A)'}")
  for n in times:
    print(f"  {n}: {statistics.median(times[n]):.4f} ms a step (range {min(times[n]):.4f}-{max(times[n]):.4f})")
  print(f"  B / A: median {statistics.median(ratios):.4f} (range {min(ratios):.4f}-{max(ratios):.4f}); "
        f"greedy tokens that differ in the first call: {differ:.3f}")
  kernels = {}
  if args.trace:
    from bench_decode import kernel_lines, trace_loop
    for n in decs:
      kernels[n], toks[n] = trace_loop(decs[n], toks[n], args.steps)
      print(f"  {n}'s traced call:", *kernel_lines(kernels[n]), sep="\n")
  return dict(times=times, ratios=ratios, differ=differ, kernels=kernels)


if __name__ == "__main__":
  main()
