"""Energy per call of the expert MLP and its kernels on a GPU held at its power cap.

Under sustained load an H100 runs at its 700 W cap, so a program's time is its energy over 700 W: a kernel
that takes more energy per cycle is clocked down, and so is every kernel that shares the card with it.
A short profile runs at the boost clock and does not show this; the benchmarks' timer does. Two parts:

--kernels SHAPES: each of the six Mosaic kernels of the fused expert MLP alone (bench_expert_mlp_parts'
  problem and arguments) and cuBLAS products of the same useful FLOPs (XLA einsums on the balanced layout
  [E, T k / E, .], and one dense product of all rows): time, SM clock, power, mJ a call, J per useful
  PFLOP and cycles a call (time x clock). Each output is first checked against its float32 reference.
--mlp SHAPES: bench_moe_layer's sparsejax_pallas and torch_grouped_mm expert MLPs (fwd+bwd), sustained, then
  ten sparsejax calls traced: whether the wall time beyond the kernels is gaps between them or clock.
  Both are first checked against the float32 reference (output and the three gradients).

Each case runs back to back for --seconds while nvidia-smi samples the SM clock and the board power every
50 ms; the medians of the last two thirds of the samples (the sustained part) are reported. Needs a GPU
and nvidia-smi:
  python experiments/probe_energy.py --kernels E64_top1_skewed,E8_top2 --mlp E64_top1_skewed,E64_top1
Results: experiments/results/mlp_power_cap_energy_H100.log (notes_hopper_kernels.md, twentieth session).
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU in --mlp
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

SAMPLE_MS = 50
QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", str(SAMPLE_MS)]


def sustained_medians(lines: list[str]) -> tuple[float, float]:
  """(SM MHz, W): medians of nvidia-smi's "clock, power" samples after the first third (the ramp)."""
  rows = [[float(v) for v in line.split(",")] for line in lines if line.strip()]
  if len(rows) < 3:
    raise ValueError(f"too few power samples ({len(rows)}): run the case for longer")
  rows = rows[len(rows) // 3:]
  return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def sustained(fn, sync, seconds: float) -> tuple[float, float, float]:
  """(seconds a call, SM MHz, W) of fn run back to back for `seconds`, synced every ten calls."""
  for _ in range(3):
    sync(fn())
  sampler = subprocess.Popen(QUERY, stdout=subprocess.PIPE, text=True)
  t0, n = time.perf_counter(), 0
  while time.perf_counter() - t0 < seconds:
    for _ in range(10):
      out = fn()
    sync(out)
    n += 10
  dt = (time.perf_counter() - t0) / n
  sampler.terminate()
  mhz, watts = sustained_medians(sampler.communicate()[0].splitlines())
  return dt, mhz, watts


def report(label: str, dt: float, mhz: float, watts: float, flops: float | None = None) -> str:
  line = f"{label:48s} {dt * 1e3:7.3f} ms  SM {mhz:5.0f} MHz  {watts:4.0f} W  {watts * dt * 1e3:7.1f} mJ a call"
  if flops:
    line += f"  {flops / dt / 1e12:6.1f} useful TF/s  {watts * dt / flops * 1e15:6.1f} J/PFLOP"
  return line + f"  {dt * mhz:7.3f} Mcycles"


def kernel_cases(shape: str) -> tuple[dict, float]:
  """{name: (jitted fn, args, want)} for the six Mosaic kernels and the cuBLAS peers, and the useful FLOPs
  of one. want: the float32 reference of the case's (first) output, compared on the real rows."""
  from bench_expert_mlp_parts import mosaic, problem, real_rows
  from sparsejax.activations import DERIVATIVES
  from sparsejax.kernels.gmm.mlp import activation_forms
  from sparsejax.kernels.gmm.reference import gmm_reference, tgmm_reference
  p = problem(shape)
  topo, x, w_in, w_out = p["topo"], p["x"], p["w_in"], p["w_out"]
  n, d, f, e = p["N"], p["d"], p["f"], p["E"]
  act, real = jax.nn.gelu, real_rows(topo)[:, None]
  dy = jnp.where(real, jax.random.normal(jax.random.key(9), (x.shape[0], d), x.dtype), 0)
  # The forms the fused MLP runs at this size: saved is act'(pre) where gmm_act saves the derivative.
  fwd_act, bwd_act = activation_forms(act, x.shape[0], e)
  saved, h = jax.jit(lambda a, b: mosaic.gmm_act(a, b, topo, fwd_act))(x, w_in)
  dpre = jax.jit(lambda a, b, c: mosaic.gmm_dact(a, b, topo, c, bwd_act))(dy, w_out, saved)
  tg = jax.jit(lambda a, b: mosaic.tgmm(a, b, topo, a.dtype))
  xb, hb, dyb = x[:n].reshape(e, n // e, d), h[:n].reshape(e, n // e, f), dy[:n].reshape(e, n // e, d)
  # float32 operands, zero outside the real rows (the kernels' outputs leave inactive blocks unwritten)
  f32 = lambda *a: [jnp.where(real, v, 0).astype(jnp.float32) if v.shape[0] == real.shape[0]
                    else v.astype(jnp.float32) for v in a]
  hi = jax.lax.Precision.HIGHEST
  ein = lambda spec, a, b: jnp.einsum(spec, *f32(a, b), precision=hi)
  mm = lambda a, w, t=False: gmm_reference(*f32(a, w), topo, transpose_rhs=t, out_dtype=jnp.float32)
  derivative = bwd_act is None
  pre_want = mm(x, w_in)
  cases = {
      "gmm_act": (jax.jit(lambda a, b: mosaic.gmm_act(a, b, topo, fwd_act)), (x, w_in),
                  DERIVATIVES[act](pre_want) if derivative else pre_want),
      "gmm h W_out": (jax.jit(lambda a, b: mosaic.gmm(a, b, topo, False, a.dtype)), (h, w_out), mm(h, w_out)),
      "gmm_dact": (jax.jit(lambda a, b, c: mosaic.gmm_dact(a, b, topo, c, bwd_act)), (dy, w_out, saved),
                   mm(dy, w_out, True) * (saved.astype(jnp.float32) if derivative
                                          else DERIVATIVES[act](saved.astype(jnp.float32)))),
      "tgmm h^T dY": (tg, (h, dy), tgmm_reference(*f32(h, dy), topo)),
      "tgmm x^T dpre": (tg, (x, dpre), tgmm_reference(*f32(x, dpre), topo)),
      "gmm_t dX": (jax.jit(lambda a, b: mosaic.gmm(a, b, topo, True, a.dtype)), (dpre, w_in), mm(dpre, w_in, True)),
      "cuBLAS bmm x W_in (balanced)": (jax.jit(lambda a, b: jnp.einsum("ecd,edf->ecf", a, b)), (xb, w_in),
                                       ein("ecd,edf->ecf", xb, w_in)),
      "cuBLAS bmm h W_out (balanced)": (jax.jit(lambda a, b: jnp.einsum("ecf,efd->ecd", a, b)), (hb, w_out),
                                        ein("ecf,efd->ecd", hb, w_out)),
      "cuBLAS bmm h^T dY (balanced)": (jax.jit(lambda a, b: jnp.einsum("ecf,ecd->efd", a, b)), (hb, dyb),
                                       ein("ecf,ecd->efd", hb, dyb)),
      "cuBLAS dense x W_in[0]": (jax.jit(lambda a, b: a @ b), (x[:n], w_in[0]), ein("nd,df->nf", x[:n], w_in[0])),
  }
  return cases, 2.0 * n * d * f, real[:, 0]


def output_error(out, want, real) -> float:
  """rel err of a case's (first) output against its float32 reference; the gmm kinds on the real rows
  only (rows of inactive blocks are unspecified)."""
  from peers.common import rel_err
  out = out[0] if isinstance(out, (tuple, list)) else out
  if out.shape[0] == real.shape[0] and out.shape == want.shape:
    out, want = out[real], want[real]
  return rel_err(out, want)


def traced_span(fn, sync, calls: int = 10) -> tuple[float, float, list[tuple[float, str, str]]]:
  """(span, busy) in us a call of `calls` traced calls, and the gaps over 1 us between kernels."""
  from peers import layer
  tmp = tempfile.mkdtemp(prefix="probe_energy_")
  try:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(calls):
        out = fn()
      sync(out)
    _, _, kernels, _ = layer.trace_device_times(glob.glob(f"{tmp}/**/perfetto_trace.json.gz", recursive=True)[0])
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  ks = [(float(k["ts"]), float(k["dur"]), k["name"]) for k in kernels]
  gaps = [(t1 - t0 - d0, n0, n1) for (t0, d0, n0), (t1, _, n1) in zip(ks, ks[1:]) if t1 - t0 - d0 > 1.0]
  return (ks[-1][0] + ks[-1][1] - ks[0][0]) / calls, sum(d for _, d, _ in ks) / calls, gaps


def mlp(shape: str, seconds: float, rounds: int) -> None:
  import bench_moe_layer
  from peers import common, sparsejax_variants, torch_grouped_mm
  p = common.make_problem({s.name: s for s in bench_moe_layer.SHAPES}[shape])
  ref = common.dropless_reference(p)
  cases = {"sparsejax": sparsejax_variants.sparsejax_case(p, ref, "pallas")}
  why_not = torch_grouped_mm.unavailable()
  if why_not:
    print(f"{shape}: torch_grouped_mm skipped ({why_not})", flush=True)
  else:
    cases["torch_grouped_mm"] = torch_grouped_mm.torch_grouped_mm(p, ref)
  for name, c in cases.items():
    got = c.check()
    print(f"{shape} MLP {name}: y rel err {got['rel_err']:.1e}, grads "
          + ", ".join(f"{v:.1e}" for v in got["grad_rel_err"]) + ("" if got["check_ok"] else "  CHECK FAILED"),
          flush=True)
  for _ in range(rounds):
    for name, c in cases.items():
      print(report(f"{shape} MLP fwd+bwd {name}", *sustained(c.fwdbwd, c.sync, seconds)), flush=True)
  c = cases["sparsejax"]
  span, busy, gaps = traced_span(c.fwdbwd, c.sync)
  print(f"{shape} sparsejax traced: span {span / 1e3:.3f} ms a call, kernels busy {busy / 1e3:.3f} ms, "
        f"{len(gaps) / 10:.1f} gaps over 1 us a call totalling {sum(g for g, _, _ in gaps) / 10:.1f} us", flush=True)
  if "torch_grouped_mm" in cases:
    torch_grouped_mm.release()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--kernels", default="", help="shapes of bench_expert_mlp_parts (tune_gmm.SHAPES)")
  ap.add_argument("--mlp", default="", help="shapes of bench_moe_layer")
  ap.add_argument("--seconds", type=float, default=3.0)
  ap.add_argument("--rounds", type=int, default=2)
  args = ap.parse_args(argv)
  kernels, mlps = [s for s in args.kernels.split(",") if s], [s for s in args.mlp.split(",") if s]
  if not (kernels or mlps):
    ap.error("nothing to do: --kernels SHAPES and/or --mlp SHAPES")
  if jax.default_backend() != "gpu" or shutil.which("nvidia-smi") is None:
    raise SystemExit("probe_energy.py needs a GPU and nvidia-smi (it samples the board's power and clock)")
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  for shape in kernels:
    cases, flops, real = kernel_cases(shape)
    for name, (fn, a, want) in cases.items():
      err = output_error(fn(*a), want, real)
      print(f"{shape} {name}: output rel err {err:.1e} against float32" + ("" if err < 2e-2 else "  CHECK FAILED"),
            flush=True)
    for r in range(args.rounds):
      for name, (fn, a, _) in cases.items():
        stats = sustained(lambda: fn(*a), jax.block_until_ready, args.seconds)
        print(report(f"{shape} round {r} {name}", *stats, flops), flush=True)
  for shape in mlps:
    mlp(shape, args.seconds, args.rounds)


if __name__ == "__main__":
  main()
