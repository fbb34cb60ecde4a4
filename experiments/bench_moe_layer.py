"""Expert-MLP and whole-layer benchmark of the dropless MoE against its peers, on one GPU.

Checks every variant against a float32 reference, then times forward and forward+backward with
warm-up and medians. Useful TFLOP/s: forward 4*N*d*f, forward+backward 12*N*d*f, N = T*k (padding
and dropped rows not counted). Writes experiments/results/moe_layer_<gpu>.{json,md,png} (and a copy
under $OUT when set).

  python experiments/bench_moe_layer.py            # the four issue shapes
  python experiments/bench_moe_layer.py --smoke    # tiny shapes, any backend (CPU: interpret mode)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback

# torch shares the GPU in the same process: leave it room.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.60")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import sparsejax as sj  # noqa: E402
from sparsejax.kernels.gmm import triton as G  # noqa: E402
from sparsejax import permute  # noqa: E402
from sparsejax.topology import make_topology  # noqa: E402

SHAPES = [  # name, T, d, f, E, k, skewed
    ("E64_top1", 16384, 1024, 4096, 64, 1, False),
    ("E64_top1_skewed", 16384, 1024, 4096, 64, 1, True),
    ("E8_top2", 16384, 2048, 8192, 8, 2, False),
    ("E64_top8", 8192, 2048, 1024, 64, 8, False),
]
SMOKE_SHAPES = [("smoke", 256, 64, 128, 4, 2, False), ("smoke_skewed", 256, 64, 128, 4, 1, True)]


def log(*a):
  print(*a, flush=True)


def timeit(fn, *args, warmup=2, iters=5, reps=5):
  """Median over reps of (wall time of `iters` back-to-back calls) / iters, after warm-up."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


def rel_err(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def routing_ids(key, T, E, k, skewed):
  """Expert ids [T, k], distinct per token: uniform, or expert i with probability ~ (i+1)^-0.5."""
  logits = jnp.zeros((E,)) if not skewed else -0.5 * jnp.log(jnp.arange(1, E + 1, dtype=jnp.float32))
  g = jax.random.gumbel(key, (T, E)) + logits  # Gumbel top-k = sampling without replacement
  return jax.lax.top_k(g, k)[1].astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# Expert-MLP variants: each takes (x_tokens [T, d], ids [T, k], w_in, w_out) -> y_rows and is
# differentiated w.r.t. x and both weights. Routing-independent work (the sort) happens outside.
# --------------------------------------------------------------------------------------------
def mlp_on_rows(mm, rows, w_in, w_out):
  return mm(jax.nn.gelu(mm(rows, w_in)), w_out)


def make_variants(T, d, f, E, k, tiling):
  N = T * k
  variants = {}

  def balanced(rows, w_in, w_out):
    r = rows[: (N // E) * E].reshape(E, N // E, d)
    mm = lambda a, w: jnp.einsum("ecd,edf->ecf", a, w, preferred_element_type=jnp.float32).astype(a.dtype)
    return mlp_on_rows(mm, r, w_in, w_out)
  variants["balanced_bmm"] = ("sorted", balanced)

  def ragged(rows, gs, w_in, w_out):
    mm = lambda a, w: jax.lax.ragged_dot(a, w, gs, preferred_element_type=jnp.float32).astype(a.dtype)
    return mlp_on_rows(mm, rows, w_in, w_out)
  variants["ragged_dot"] = ("grouped", ragged)

  def pallas(rows_padded, topo, w_in, w_out):
    mm = lambda a, w: G.gmm(a, w, topo, False, a.dtype, tiling)
    return mlp_on_rows(mm, rows_padded, w_in, w_out)
  variants["sparsejax_pallas"] = ("padded", pallas)

  for cf in (1.0, 1.25, 2.0):
    def cap(buf, w_in, w_out, _E=E):
      mm = lambda a, w: jnp.einsum("ecd,edf->ecf", a, w, preferred_element_type=jnp.float32).astype(a.dtype)
      return mlp_on_rows(mm, buf.reshape(_E, -1, buf.shape[-1]), w_in, w_out)
    variants[f"capacity_einsum_cf{cf}"] = (("capacity", cf), cap)
  return variants


def bench_shape(name, T, d, f, E, k, skewed, tiling, dtype, quick):
  log(f"\n=== {name}: T={T} d={d} f={f} E={E} k={k} skewed={skewed}")
  N = T * k
  keys = jax.random.split(jax.random.key(hash(name) % 2**31), 6)
  x = jax.random.normal(keys[0], (T, d), dtype)
  w_in = (jax.random.normal(keys[1], (E, d, f), jnp.float32) / math.sqrt(d)).astype(dtype)
  w_out = (jax.random.normal(keys[2], (E, f, d), jnp.float32) / math.sqrt(f)).astype(dtype)
  ids = routing_ids(keys[3], T, E, k, skewed)
  counts = np.bincount(np.asarray(ids).reshape(-1), minlength=E)
  log(f"tokens per expert: min {counts.min()} max {counts.max()} mean {counts.mean():.0f}")

  fwd_flops, fb_flops = 4 * N * d * f, 12 * N * d * f
  results = []

  # Layouts, built once outside the timed functions.
  pl_dropless = permute.dropless_placement(ids, E, block_size=128)
  topo = make_topology(pl_dropless.group_sizes, pl_dropless.num_rows, 128)
  rows_padded = permute.gather_rows(x, pl_dropless)
  pl_sorted = permute.dropless_placement(ids, E)
  rows_sorted = permute.gather_rows(x, pl_sorted)
  gs = pl_sorted.group_sizes

  # Reference for the dropless expert MLP: float32 masked dense, on the sorted rows.
  def ref_mlp(rows):
    mm = lambda a, w: sj.grouped_matmul_reference(a.astype(jnp.float32), w.astype(jnp.float32), gs)
    return mlp_on_rows(mm, rows, w_in, w_out)
  y_ref = jax.jit(ref_mlp)(rows_sorted)
  # Where each sorted row sits in the padded layout, to compare padded outputs with the reference.
  src_sorted = permute.source_tokens(pl_sorted, T)  # token of each sorted row (k slots flattened)
  pad_pos = pl_dropless.rows.reshape(-1)[jnp.argsort(pl_sorted.rows.reshape(-1))]

  ct = jax.random.normal(keys[4], (N, d), dtype)  # a fixed cotangent, never zeros

  for vname, (layout, fn) in make_variants(T, d, f, E, k, tiling).items():
    if quick and vname.startswith("capacity") and "1.25" in vname:
      continue
    rec = dict(shape=name, variant=vname, T=T, d=d, f=f, E=E, k=k, skewed=skewed)
    t_start = time.perf_counter()
    try:
      if layout == "sorted":
        args, useful = (rows_sorted,), N
        check = lambda out: rel_err(out.reshape(-1, d)[: N], jax.jit(lambda r: mlp_on_rows(
            lambda a, w: jnp.einsum("ecd,edf->ecf", a.astype(jnp.float32), w.astype(jnp.float32)),
            r[: (N // E) * E].reshape(E, N // E, d), w_in, w_out))(rows_sorted).reshape(-1, d)[:N])
      elif layout == "grouped":
        args, useful = (rows_sorted, gs), N
        check = lambda out: rel_err(out, y_ref)
      elif layout == "padded":
        args, useful = (rows_padded, topo), N
        check = lambda out: rel_err(out[pad_pos], y_ref)
      else:
        cf = layout[1]
        c = sj.capacity(T, E, k, cf)
        plc = permute.capacity_placement(ids, E, c)
        buf = permute.gather_rows(x, plc)
        dropped = int(plc.num_dropped)
        rec.update(capacity_factor=cf, dropped_fraction=dropped / N)
        args, useful = (buf,), N - dropped
        def check(out, plc=plc, buf=buf):
          mm = lambda a, w: jnp.einsum("ecd,edf->ecf", a.astype(jnp.float32), w.astype(jnp.float32))
          ref = jax.jit(lambda b: mlp_on_rows(mm, b.reshape(E, -1, d), w_in, w_out))(buf)
          return rel_err(out.reshape(-1, d), ref.reshape(-1, d))
      params = (w_in, w_out)
      fwd = jax.jit(lambda *a: fn(*a))
      out = fwd(*args, *params)
      err = check(out)
      rec["rel_err"] = err
      ok = err < 2e-2
      rec["check_ok"] = ok
      slow = vname == "ragged_dot"
      t = timeit(fwd, *args, *params, warmup=1 if slow else 2, iters=1 if slow else 5, reps=3 if slow else 5)
      rec["fwd_ms"] = t * 1e3
      rec["fwd_tflops"] = 4 * useful * d * f / t / 1e12

      def loss(xrows, w_in_, w_out_):
        o = fn(xrows, *args[1:], w_in_, w_out_).reshape(-1, d)
        c2 = ct if o.shape[0] == N else jnp.resize(ct, o.shape)  # a fixed non-zero cotangent
        return jnp.sum(o.astype(jnp.float32) * c2.astype(jnp.float32))
      fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(args[0], *params).compile()
      g = fb(args[0], *params)
      rec["grads_finite"] = bool(all(bool(jnp.all(jnp.isfinite(gi))) for gi in g))
      t = timeit(fb, args[0], *params, warmup=1 if slow else 2, iters=1 if slow else 5, reps=3 if slow else 5)
      rec["fwdbwd_ms"] = t * 1e3
      rec["fwdbwd_tflops"] = 12 * useful * d * f / t / 1e12
      try:
        mem = fb.memory_analysis()
        rec["fwdbwd_temp_bytes"] = int(mem.temp_size_in_bytes)
      except Exception:  # memory_analysis is best effort across versions
        pass
      log(f"{vname:24s} err {err:.1e} fwd {rec['fwd_tflops']:6.1f} TF/s  fwd+bwd {rec['fwdbwd_tflops']:6.1f} TF/s"
          + (f"  dropped {rec.get('dropped_fraction', 0):.3f}" if "capacity" in vname else ""))
    except Exception as e:  # noqa: BLE001 — an OOM or failure is a result too
      rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      log(f"{vname:24s} FAILED {rec['error']}")
    rec["bench_wall_s"] = time.perf_counter() - t_start
    results.append(rec)
  # Ideal memory of the dropless layer's activations: x rows, h, act(h), y rows, unpadded, plus
  # one block per expert.
  bpe = jnp.dtype(dtype).itemsize
  ideal = (N + E * 128) * (2 * d + 2 * f) * bpe
  for r in results:
    r["ideal_activation_bytes"] = ideal
  return results


def bench_whole_layer(name, T, d, f, E, k, skewed, dtype, tiling):
  """Routing + permutation + experts + un-permutation, forward+backward, dropless vs capacity 1.0."""
  keys = jax.random.split(jax.random.key(7), 5)
  x = jax.random.normal(keys[0], (T, d), dtype)
  w_r = jax.random.normal(keys[1], (d, E), jnp.float32) * 0.02
  # Fixed Gumbel noise plus a log-prior makes the top-1 choice a sample from the shape's routing
  # distribution (uniform, or (i+1)^-0.5), while the router stays a real, differentiated layer.
  bias = jax.random.gumbel(jax.random.key(11), (T, E))
  if skewed:
    bias = bias - 0.5 * jnp.log(jnp.arange(1, E + 1, dtype=jnp.float32))
  w_in = (jax.random.normal(keys[2], (E, d, f)) / math.sqrt(d)).astype(dtype)
  w_out = (jax.random.normal(keys[3], (E, f, d)) / math.sqrt(f)).astype(dtype)
  ct = jax.random.normal(keys[4], (T, d), dtype)
  out = []
  for label, impl, cf in [("dropless_pallas", "pallas", None), ("dropless_ragged_dot", "ragged_dot", None),
                          ("capacity_1.0", "auto", 1.0)]:
    if impl == "ragged_dot" and E * T * k * f * 2 >= 4 * 2**30:
      # ragged_dot's backward materializes about E x N x f: out of memory here (49 GiB asked
      # for at E=64, T=16384, f=4096 on an H100, 2026-11-22); the expert-MLP table still times it.
      out.append(dict(shape=name, layer=label, error="skipped: E*N*f buffer exceeds 8 GiB (OOM)"))
      continue
    def layer(x, w_r, w_in, w_out):
      logits = sj.router_logits(x, w_r) + bias
      r = sj.top_k_routing(logits, k)
      y, st = sj.moe_mlp(x, r.expert_ids, r.combine_weights.astype(x.dtype), w_in, w_out,
                         capacity_factor=cf, impl=impl)
      return jnp.sum(y.astype(jnp.float32) * ct) + sj.load_balancing_loss(r.router_probs, r.expert_ids), st
    fb = jax.jit(jax.value_and_grad(layer, argnums=(0, 1, 2, 3), has_aux=True))
    rec = dict(shape=name, layer=label)
    try:
      (l, st), g = fb(x, w_r, w_in, w_out)
      rec["dropped_fraction"] = float(st.dropped_fraction)
      t = timeit(fb, x, w_r, w_in, w_out)
      rec["fwdbwd_ms"] = t * 1e3
      rec["tokens_per_s"] = T / t
      log(f"layer {label:22s} fwd+bwd {t*1e3:7.2f} ms  dropped {rec['dropped_fraction']:.3f}")
    except Exception as e:  # noqa: BLE001
      rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      log(f"layer {label} FAILED {rec['error']}")
    out.append(rec)
  return out


GMM_TILINGS = [(128, 64, 4, 3), (128, 64, 8, 4), (256, 64, 8, 3), (128, 128, 8, 2), (256, 32, 8, 4)]
TGMM_TILINGS = [(128, 128, 4, 2), (128, 256, 8, 2), (256, 128, 8, 2), (128, 128, 8, 3), (64, 128, 4, 2)]


def bench_kernels(T, d, f, E, dtype):
  """The four products of one layer alone, per tiling, against the balanced batched matmul.

  Returns the rows and the Tiling made of the fastest gmm and tgmm settings (a small autotune).
  """
  keys = jax.random.split(jax.random.key(3), 4)
  ids = routing_ids(keys[0], T, E, 1, False)
  plc = permute.dropless_placement(ids, E, block_size=128)
  topo = make_topology(plc.group_sizes, plc.num_rows, 128)
  R = plc.num_rows
  a = jax.random.normal(keys[1], (R, d), dtype)
  h = jax.random.normal(keys[2], (R, f), dtype)
  w_in = jax.random.normal(keys[3], (E, d, f), dtype)
  w_out = jax.random.normal(keys[3], (E, f, d), dtype)
  flops = 2 * T * d * f
  rows = []
  bal_a, bal_h = a[:T].reshape(E, T // E, d), h[:T].reshape(E, T // E, f)
  base = {
      "x@Win": (jax.jit(lambda a, w: jnp.einsum("ecd,edf->ecf", a, w)), (bal_a, w_in)),
      "h@Wout": (jax.jit(lambda a, w: jnp.einsum("ecf,efd->ecd", a, w)), (bal_h, w_out)),
      "dh@Win^T": (jax.jit(lambda a, w: jnp.einsum("ecf,edf->ecd", a, w)), (bal_h, w_in)),
      "x^T@dh": (jax.jit(lambda a, g: jnp.einsum("ecd,ecf->edf", a, g)), (bal_a, bal_h)),
  }
  for op, (fn, args) in base.items():
    t = timeit(fn, *args)
    rows.append(dict(op=op, tiling="balanced_bmm", ms=t * 1e3, tflops=flops / t / 1e12))
  best_gmm, best_tgmm = (None, 1e9), (None, 1e9)
  for bn, bk, w, st in GMM_TILINGS:
    ti = G.Tiling(block_n=bn, block_k=bk, num_warps=w, num_stages=st)
    ops = {
        "x@Win": (jax.jit(lambda a, w: G.gmm(a, w, topo, False, a.dtype, ti)), (a, w_in)),
        "h@Wout": (jax.jit(lambda a, w: G.gmm(a, w, topo, False, a.dtype, ti)), (h, w_out)),
        "dh@Win^T": (jax.jit(lambda a, w: G.gmm(a, w, topo, True, a.dtype, ti)), (h, w_in)),
    }
    total = 0.0
    for op, (fn, args) in ops.items():
      try:
        t = timeit(fn, *args)
        total += t
        rows.append(dict(op=op, tiling=[bn, bk, w, st], ms=t * 1e3, tflops=flops / t / 1e12))
      except Exception as e:  # noqa: BLE001
        total += 1e9
        rows.append(dict(op=op, tiling=[bn, bk, w, st], error=str(e)[:200]))
    if total < best_gmm[1]:
      best_gmm = ((bn, bk, w, st), total)
  for bk, bn, w, st in TGMM_TILINGS:
    ti = G.Tiling(tgmm_block_k=bk, tgmm_block_n=bn, tgmm_num_warps=w, tgmm_num_stages=st)
    try:
      t = timeit(jax.jit(lambda a, g: G.tgmm(a, g, topo, a.dtype, ti)), a, h)
      rows.append(dict(op="x^T@dh", tiling=[bk, bn, w, st], ms=t * 1e3, tflops=flops / t / 1e12))
      if t < best_tgmm[1]:
        best_tgmm = ((bk, bn, w, st), t)
    except Exception as e:  # noqa: BLE001
      rows.append(dict(op="x^T@dh", tiling=[bk, bn, w, st], error=str(e)[:200]))
  for r in rows:
    log(f"kernel {r['op']:10s} {str(r['tiling']):20s} "
        + (f"{r['tflops']:6.1f} TF/s" if "tflops" in r else r.get("error", "")[:150]))
  tiling = G.DEFAULT_TILING
  if best_gmm[0]:
    bn, bk, w, st = best_gmm[0]
    tiling = dataclasses.replace(tiling, block_n=bn, block_k=bk, num_warps=w, num_stages=st)
  if best_tgmm[0]:
    bk, bn, w, st = best_tgmm[0]
    tiling = dataclasses.replace(tiling, tgmm_block_k=bk, tgmm_block_n=bn, tgmm_num_warps=w,
                                 tgmm_num_stages=st)
  log(f"autotuned tiling: {tiling}")
  return rows, tiling


TORCH_SNIPPET = r"""
import json, math, sys, torch, triton
T,d,f,E,k,skewed = json.loads(sys.argv[1])
N=T*k
torch.manual_seed(0)
g=torch.Generator(device='cuda').manual_seed(1)
logits = torch.zeros(E, device='cuda') if not skewed else -0.5*torch.log(torch.arange(1,E+1,device='cuda',dtype=torch.float32))
gum = -torch.log(-torch.log(torch.rand(T,E,device='cuda',generator=g)))+logits
ids = gum.topk(k,dim=-1).indices.reshape(-1)
counts = torch.bincount(ids, minlength=E)
offs = torch.cumsum(counts,0).to(torch.int32)
x = torch.randn(N,d,device='cuda',dtype=torch.bfloat16)
w_in = (torch.randn(E,f,d,device='cuda')/math.sqrt(d)).to(torch.bfloat16).transpose(-2,-1)
w_out = (torch.randn(E,d,f,device='cuda')/math.sqrt(f)).to(torch.bfloat16).transpose(-2,-1)
def mlp(x,wi,wo):
  return torch._grouped_mm(torch.nn.functional.gelu(torch._grouped_mm(x,wi,offs=offs)),wo,offs=offs)
out = mlp(x,w_in,w_out)
# check against a per-expert loop in float32
ref = torch.empty(N,d,device='cuda'); s=0
for e in range(E):
  c=int(counts[e]); xs=x[s:s+c].float(); ref[s:s+c]=torch.nn.functional.gelu(xs@w_in[e].float())@w_out[e].float(); s+=c
err = float((out.float()-ref).norm()/ref.norm())
res = dict(rel_err=err)
t = triton.testing.do_bench(lambda: mlp(x,w_in,w_out), warmup=50, rep=300, return_mode='median')
res['fwd_ms']=t; res['fwd_tflops']=4*N*d*f/(t*1e-3)/1e12
xg=x.clone().requires_grad_(); wi=w_in.detach().clone().requires_grad_(); wo=w_out.detach().clone().requires_grad_()
ct=torch.randn(N,d,device='cuda',dtype=torch.bfloat16)
def fb():
  xg.grad=wi.grad=wo.grad=None
  mlp(xg,wi,wo).backward(ct)
try:
  fb()
  t = triton.testing.do_bench(fb, warmup=50, rep=300, return_mode='median')
  res['fwdbwd_ms']=t; res['fwdbwd_tflops']=12*N*d*f/(t*1e-3)/1e12
except Exception as e:
  res['bwd_error']=str(e)[:300]
print('JSON'+json.dumps(res))
"""


def bench_torch(T, d, f, E, k, skewed):
  try:
    import torch  # noqa: F401
  except ImportError:
    return dict(error="torch not importable")
  env = dict(os.environ)
  p = subprocess.run([sys.executable, "-c", TORCH_SNIPPET, json.dumps([T, d, f, E, k, skewed])],
                     capture_output=True, text=True, env=env, timeout=240)
  for line in p.stdout.splitlines():
    if line.startswith("JSON"):
      return json.loads(line[4:])
  return dict(error=(p.stderr or p.stdout)[-400:])


def merge_previous(results, path):
  """Keep the records of shapes this run did not measure (runs are split to fit a time limit)."""
  if not os.path.exists(path):
    return results
  with open(path) as fh:
    old = json.load(fh)
  for key in ("mlp", "layer"):
    now = {r["shape"] for r in results[key]}
    kept = [r for r in old.get(key, []) if r["shape"] not in now]
    results[key] = kept + results[key]
  if not results.get("kernels"):
    results["kernels"] = old.get("kernels", [])
  return results


def write_outputs(all_results, gpu, out_dir, merge=False):
  os.makedirs(out_dir, exist_ok=True)
  stem = os.path.join(out_dir, f"moe_layer_{gpu}")
  if merge:
    all_results = merge_previous(all_results, stem + ".json")
  with open(stem + ".json", "w") as fh:
    json.dump(all_results, fh, indent=1)
  lines = ["| shape | variant | fwd TFLOP/s | fwd+bwd TFLOP/s | % of balanced (fwd+bwd) | dropped | rel err |",
           "|---|---|---|---|---|---|---|"]
  for shape in dict.fromkeys(r["shape"] for r in all_results["mlp"]):
    rs = [r for r in all_results["mlp"] if r["shape"] == shape]
    bal = next((r.get("fwdbwd_tflops") for r in rs if r["variant"] == "balanced_bmm"), None)
    for r in rs:
      fb = r.get("fwdbwd_tflops")
      pct = f"{100 * fb / bal:.0f}%" if fb and bal else ""
      lines.append(f"| {shape} | {r['variant']} | {r.get('fwd_tflops', float('nan')):.1f} | "
                   f"{fb if fb is None else round(fb, 1)} | {pct} | {r.get('dropped_fraction', 0):.3f} | "
                   f"{r.get('rel_err', float('nan')):.1e} |" + (f" {r['error'][:60]}" if "error" in r else ""))
  if all_results.get("layer"):
    lines += ["", "| shape | whole layer | fwd+bwd ms | tokens/s | dropped |", "|---|---|---|---|---|"]
    for r in all_results["layer"]:
      lines.append(f"| {r['shape']} | {r['layer']} | {r.get('fwdbwd_ms', float('nan')):.2f} | "
                   f"{r.get('tokens_per_s', float('nan')):.3g} | {r.get('dropped_fraction', float('nan')):.3f} |"
                   + (f" {r['error'][:70]}" if "error" in r else ""))
  table = "\n".join(lines)
  with open(stem + ".md", "w") as fh:
    fh.write(f"# MoE expert MLP on {gpu}\n\n{table}\n")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = list(dict.fromkeys(r["shape"] for r in all_results["mlp"]))
    variants = list(dict.fromkeys(r["variant"] for r in all_results["mlp"]))
    fig, ax = plt.subplots(figsize=(12, 5))
    w = 0.8 / len(variants)
    for vi, v in enumerate(variants):
      vals = [next((r.get("fwdbwd_tflops") or 0 for r in all_results["mlp"]
                    if r["shape"] == s and r["variant"] == v), 0) for s in shapes]
      ax.bar(np.arange(len(shapes)) + vi * w, vals, w, label=v)
    ax.set_xticks(np.arange(len(shapes)) + 0.4 - w / 2, shapes)
    ax.set_ylabel("useful TFLOP/s, forward+backward")
    ax.set_title(f"MoE expert MLP, bf16, {gpu}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
  except Exception as e:  # noqa: BLE001
    log("plot failed:", e)
  if os.environ.get("OUT"):
    for ext in (".json", ".md", ".png"):
      if os.path.exists(stem + ext):
        shutil.copy(stem + ext, os.environ["OUT"])
  return table


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--shapes", default="all")
  ap.add_argument("--sweep", action="store_true", help="time the kernels alone over several tilings")
  ap.add_argument("--no-torch", action="store_true")
  ap.add_argument("--merge", action="store_true", help="keep earlier results for shapes not run now")
  ap.add_argument("--layer-only", action="store_true", help="time only the whole layer")
  ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
  args = ap.parse_args()
  dev = jax.devices()[0]
  gpu = dev.device_kind.replace(" ", "_").replace("/", "_") if dev.platform == "gpu" else "cpu"
  log(f"jax {jax.__version__} on {dev.device_kind}")
  dtype = jnp.bfloat16
  shapes = SMOKE_SHAPES if args.smoke else SHAPES
  if args.shapes != "all":
    shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
  tiling = G.DEFAULT_TILING
  results = dict(gpu=gpu, jax=jax.__version__, tiling=dataclasses.asdict(tiling), mlp=[], layer=[], kernels=[],
                 torch=[])
  if args.sweep and not args.smoke:
    results["kernels"], tiling = bench_kernels(16384, 1024, 4096, 64, dtype)
    results["tiling"] = dataclasses.asdict(tiling)
    G.DEFAULT_TILING = tiling  # the whole-layer runs go through moe_mlp, which reads the default
  for s in shapes:
    name, T, d, f, E, k, skewed = s
    if args.layer_only:
      results["layer"] += bench_whole_layer(name, T, d, f, E, k, skewed, dtype, tiling)
      write_outputs(dict(results), gpu, args.out_dir, args.merge)
      continue
    results["mlp"] += bench_shape(name, T, d, f, E, k, skewed, tiling, dtype, quick=False)
    if not args.no_torch and dev.platform == "gpu":
      tr = bench_torch(T, d, f, E, k, skewed)
      log(f"torch._grouped_mm: {tr}")
      rec = dict(shape=name, variant="torch_grouped_mm", **{kk: v for kk, v in tr.items()})
      results["mlp"].append(rec)
    results["layer"] += bench_whole_layer(name, T, d, f, E, k, skewed, dtype, tiling)
    write_outputs(dict(results), gpu, args.out_dir, args.merge)  # partial results survive a timeout
  table = write_outputs(results, gpu, args.out_dir, args.merge)
  log("\n" + table)


if __name__ == "__main__":
  main()
