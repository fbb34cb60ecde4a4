"""The decode probes' timing harness: jitted chains of many dependent calls, timed interleaved, traced by kernel.

A probe builds one jitted function per variant, each running `calls` dependent calls (steps x layers) through
distinct weights; outputs feed the next call, so XLA can neither hoist nor drop one. Every round times every
variant once (interleaved, so a clock or power drift hits them alike); the medians are reported. --trace runs
each chain once under the profiler (with XLA's command buffers off, XLA_FLAGS=--xla_gpu_enable_command_buffer=,
so each kernel is its own event) and prints its kernels' device time a call.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def add_chain_args(ap, layers_help: str = "calls in the chain, each with its own weights") -> None:
  """--layers, --steps, --rounds and --trace, as every probe takes them."""
  ap.add_argument("--layers", type=int, default=24, help=layers_help)
  ap.add_argument("--steps", type=int, default=100, help="passes over the layers in one timed call")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--trace", metavar="DIR", help="also trace one call of each chain into DIR and print its kernels' "
                  "device time a layer (run with XLA_FLAGS=--xla_gpu_enable_command_buffer=, so each kernel is traced)")


def run_check(check, what: str, width: int = 24) -> tuple[dict, bool]:
  """(errs, on_gpu): check(interpret=...) run compiled on a GPU, else in interpret mode, each error printed."""
  on_gpu = jax.default_backend() == "gpu"
  errs = check(interpret=not on_gpu)
  for name, err in errs.items():
    print(f"{name:>{width}}: {what} {err:.3g}")
  return errs, on_gpu


def halve(x):
  """x / 2 in x's dtype: keeps a chain's values bounded over thousands of calls."""
  return (x.astype(jnp.float32) * 0.5).astype(x.dtype)


def compare_outputs(fns: dict, args_of: dict, base: str, what: str, width: int = 24, skip=lambda n: False) -> None:
  """Runs every chain once (compiling it before any timing) and prints its output's largest difference from base's,
  except for the chains skip(name) names (whose output is not the same function's)."""
  outs = {n: np.asarray(jax.block_until_ready(g(*args_of[n])), np.float32) for n, g in fns.items()}
  for n, o in outs.items():
    if not skip(n):
      print(f"{n:>{width}}: {what}, max |diff| from {base} {np.max(np.abs(o - outs[base])):.3g}")


def time_interleaved(fns: dict, args_of: dict, rounds: int, calls: int) -> dict[str, list[float]]:
  """us a call of each chain, one time a round each, the chains interleaved within a round."""
  times = {n: [] for n in fns}
  for _ in range(rounds):
    for n, g in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(g(*args_of[n]))
      times[n].append((time.perf_counter() - t) / calls * 1e6)
  return times


def print_times(times: dict, base: str, unit: str, width: int = 24) -> None:
  b = np.median(times[base])
  for n, t in times.items():
    print(f"{n:>{width}}: {np.median(t):6.2f} us {unit} (median of {len(t)}, range {min(t):.2f}-{max(t):.2f}; "
          f"{np.median(t) / b:.2f}x {base})")


def print_trace(fns: dict, args_of: dict, log_dir: str, calls: int, unit: str) -> None:
  """Each chain traced once into log_dir/<name>: its busy time and kernels' device time a call, by kind."""
  import profile_step
  for n in fns:
    with jax.profiler.trace(f"{log_dir}/{n}"):
      jax.block_until_ready(fns[n](*args_of[n]))
    table = profile_step.kernel_table(profile_step.load_trace(f"{log_dir}/{n}"), calls, by_kind=True)
    print(f"{n}: device busy {1e3 * table['busy_union_ms']:.2f} us {unit}; by kernel (us {unit}, launches):")
    for kind, ms, launches in table["kernels"]:
      print(f"  {kind:<48} {1e3 * ms:7.2f}  {launches:.0f}")


def compare_and_time(fns: dict, args_of: dict, base: str, args, layers: int, *, width: int = 24,
                     skip=lambda n: False, megabytes: float | None = None) -> dict[str, list[float]]:
  """A probe's usual run over chains of args.steps x layers calls: outputs compared with base's, times interleaved
  and printed a layer, the bytes' time at 2.9 TB/s where megabytes (a layer) is given, and the trace on --trace."""
  compare_outputs(fns, args_of, base, f"chain of {args.steps} x {layers}", width=width, skip=skip)
  times = time_interleaved(fns, args_of, args.rounds, args.steps * layers)
  print_times(times, base, "a layer", width=width)
  if megabytes is not None:
    print(f"bytes a layer {megabytes:.1f} MB: {megabytes / 2.9:.2f} us at 2.9 TB/s")
  if args.trace:
    print_trace(fns, args_of, args.trace, args.steps * layers, "a layer")
  return times
