"""Expert-parallel MoE on several GPUs: equivalence with one GPU, then weak scaling and all-to-all time.

  python experiments/bench_expert_parallel.py            # on a machine with 2 (or 4) GPUs
  python experiments/bench_expert_parallel.py --smoke    # on the CPU, 8 fake host devices, tiny shapes

1. Equivalence: on every GPU count n, expert_parallel_moe_mlp (dropless; and capacity mode, against
   moe_mlp per device token shard) against single-device moe_mlp, float32, values and gradients.
2. Weak scaling: the MoE layer's forward+backward (grads of x, combine weights, w_in, w_out) at a
   fixed per-GPU batch (T = 16384 per GPU, d = 1024, f = 4096, E = 64, top-1, bf16, random router
   logits), on 1 GPU (plain moe_mlp, no shard_map) and on n GPUs (mesh 1 x n, experts sharded).
   Efficiency(n) = tokens/s(n) / (n * tokens/s(1)).
3. All-to-all alone: a jitted function doing only the exchange of one [n, S, d] buffer, timed the
   same way; a forward+backward does four of them (dispatch and return, and their transposes).
--dispatches measures each dropless exchange with each ExpertParallelConfig.dispatch: "assignments" (a
row per token and expert, S = T min(k, E/n)) and "tokens" (a row per token and peer, S = T).
Warm-up, then the median of timed calls (each blocked on). Prints a markdown table last; writes JSON to
experiments/results/expert_parallel_<gpu>_x<n>[_top<k>].json and to $OUT if set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# NVLink multicast (NVLS) off, as the device machines require; before jax (and NCCL) load.
os.environ["NCCL_NVLS_ENABLE"] = "0"
if "--smoke" in sys.argv:
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sparsejax as sj  # noqa: E402
from sparsejax import mesh as meshlib, parallel  # noqa: E402
from sparsejax.exchange import dense_all_to_all, ragged_all_to_all_rows  # noqa: E402
from sparsejax.grouped_matmul import resolve_impl  # noqa: E402

from peers.common import time_fn  # noqa: E402

START = time.perf_counter()


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true", help="CPU, 8 host devices, tiny shapes")
  p.add_argument("--tokens-per-gpu", type=int, default=16384)
  p.add_argument("--d-model", type=int, default=1024)
  p.add_argument("--d-ff", type=int, default=4096)
  p.add_argument("--experts", type=int, default=64)
  p.add_argument("--top-k", type=int, default=1)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--impl", default="auto", help="grouped matmul backend (auto = Pallas on GPU)")
  p.add_argument("--exchanges", default="ragged,dense",
                 help="dropless exchanges to time: ragged (real rows only) and/or dense (whole buffer)")
  p.add_argument("--buffer-factors", default="none",
                 help="dropless exchange buffers to time: none = the safe worst-case bound")
  p.add_argument("--dispatches", default="assignments",
                 help="comma list of ExpertParallelConfig.dispatch: assignments (a row per token and expert), "
                      "tokens (a row per token and peer)")
  p.add_argument("--capacity-factor", type=float, default=1.25, help="capacity-mode baseline; 0 = skip")
  p.add_argument("--gpus", default="", help="comma list of device counts (default 1, 2, 4, ... up to all)")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--skip-equivalence", action="store_true", help="timings only (an earlier run checked)")
  p.add_argument("--tag", default="", help="suffix of the JSON's name")
  p.add_argument("--budget-s", type=float, default=300.0, help="skip remaining timings past this")
  a = p.parse_args()
  bad = [x for x in a.dispatches.split(",") if x not in parallel.DISPATCHES]
  if bad:
    p.error(f"--dispatches takes a comma list of {', '.join(parallel.DISPATCHES)}; got {bad}")
  if a.smoke:
    a.tokens_per_gpu, a.d_model, a.d_ff, a.experts, a.dtype = 64, 32, 64, 8, "float32"
    a.warmup, a.iters = 1, 3
  return a


def make_problem(key, tokens, d, f, experts, k, dtype, token_sharding=None, layout=None):
  """Random x, router top-k of random logits, weights, cotangent; created already sharded."""
  def build(key):
    ks = jax.random.split(key, 5)
    x = jax.random.normal(ks[0], (tokens, d), jnp.float32).astype(dtype)
    r = sj.top_k_routing(jax.random.normal(ks[1], (tokens, experts), jnp.float32), k)
    w_in = (jax.random.normal(ks[2], (experts, d, f), jnp.float32) / np.sqrt(d)).astype(dtype)
    w_out = (jax.random.normal(ks[3], (experts, f, d), jnp.float32) / np.sqrt(f)).astype(dtype)
    g = jax.random.normal(ks[4], (tokens, d), jnp.float32).astype(dtype)
    return x, r.expert_ids, r.combine_weights.astype(dtype), w_in, w_out, g
  out_shardings = None
  if layout is not None:
    tok = layout.sharding(layout.tokens)
    out_shardings = (tok, tok, tok, layout.sharding(layout.w_in()), layout.sharding(layout.w_out()), tok)
  return jax.jit(build, out_shardings=out_shardings)(key)


def fwd_bwd(layer):
  """jit of (y, grads of <y, g> w.r.t. x, combine_weights, w_in, w_out)."""
  def loss(x, cw, w_in, w_out, ids, g):
    y, stats = layer(x, ids, cw, w_in, w_out)
    return jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32)), (y, stats)

  @jax.jit
  def step(x, ids, cw, w_in, w_out, g):
    (_, (y, stats)), grads = jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)(
        x, cw, w_in, w_out, ids, g)
    return (y, grads), stats
  return step


def single_layer(impl, capacity_factor=None, shards=1):
  def layer(x, ids, cw, w_in, w_out):
    parts = [sj.moe_mlp(a, b, c, w_in, w_out, impl=impl, capacity_factor=capacity_factor)[0]
             for a, b, c in zip(jnp.split(x, shards), jnp.split(ids, shards), jnp.split(cw, shards))]
    return jnp.concatenate(parts), {}
  return layer


def ep_layer(mesh, impl, config, capacity_factor=None):
  return lambda x, ids, cw, w_in, w_out: parallel.expert_parallel_moe_mlp(
      x, ids, cw, w_in, w_out, mesh=mesh, parallel=config, impl=impl,
      capacity_factor=capacity_factor)


def max_rel_err(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def equivalence(n, args):
  """float32, a smaller shape: EP on n devices against moe_mlp on one; dropless and capacity."""
  devices = jax.devices()[:n]
  mesh = meshlib.make_expert_mesh(1, n, devices=devices)
  tokens = (256 if args.smoke else 1024) * n
  d, f = (32, 64) if args.smoke else (256, 512)
  prob = make_problem(jax.random.key(1), tokens, d, f, args.experts, max(args.top_k, 2), jnp.float32)
  results = {}
  modes = [(f"dropless {ex}" + ("" if dp == "assignments" else f" dispatch={dp}"), None, ex, dp)
           for dp in args.dispatches.split(",") for ex in args.exchanges.split(",")]
  for mode, cf, ex, dp in modes + [("capacity", 1.0, "auto", "assignments")]:
    with jax.default_matmul_precision("highest"):
      config = parallel.ExpertParallelConfig(exchange=ex, dispatch=dp)
      ep = fwd_bwd(ep_layer(mesh, args.impl, config, cf))(*prob)[0]
      with jax.default_device(devices[0]):
        one = fwd_bwd(single_layer(args.impl, cf, 1 if cf is None else n))(
            *jax.device_put(prob, devices[0]))[0]
    errs = [max_rel_err(a, b) for a, b in zip(jax.tree.leaves(ep), jax.tree.leaves(one))]
    results[mode] = {"max_rel_err": max(errs), "ok": bool(max(errs) < 1e-3)}
  return results


def a2a_time(layout, slots, d, dtype, args, expert_ids, hierarchical=False, exchange="dense", dispatch="assignments"):
  """Seconds of one exchange of a [P, S, d] buffer per device (the dispatch, alone). Ragged: the
  rows the routing `expert_ids` really places per peer (a row per assignment or per token and
  peer, as `dispatch`), after the exchange of their counts."""
  p = layout.num_peers
  shards = layout.mesh.devices.size
  spec = layout.tokens
  buf = jax.jit(lambda k: jax.random.normal(k, (shards * p * slots, d), jnp.float32).astype(dtype),
                out_shardings=layout.sharding(spec))(jax.random.key(3))

  def body(b, ids):
    b = b.reshape(p, slots, d)
    if exchange == "dense":
      return dense_all_to_all(b, layout, hierarchical).reshape(-1, d)
    if dispatch == "tokens":
      _, sent = parallel.peer_token_placement(ids, args.experts, p)
    else:
      sent = parallel.peer_placement(ids, args.experts, p, slots)[1].sum(axis=1)
    recv = dense_all_to_all(sent, layout, False)
    return ragged_all_to_all_rows(b, sent, recv, layout,
                                  chunks=parallel.ExpertParallelConfig.ragged_chunks).reshape(-1, d)
  f = jax.jit(parallel._shard_map(body, layout.mesh, (spec, spec), spec, check=False))
  return time_fn(f, buf, expert_ids, warmup=args.warmup, iters=args.iters)


def main():
  args = parse_args()
  dtype = jnp.dtype(args.dtype)
  ndev = len(jax.devices())
  counts = [int(c) for c in args.gpus.split(",")] if args.gpus else [
      c for c in (1, 2, 4, 8) if c <= ndev and args.experts % c == 0]
  kind = jax.devices()[0].device_kind.lower().replace(" ", "_").replace("nvidia_", "")
  # top-k beyond 1 in the name, so a top-2 run does not overwrite the top-1 one.
  gpu = (f"{'cpu_smoke' if args.smoke else kind}_x{max(counts)}" + (f"_top{args.top_k}" if args.top_k != 1 else "")
         + args.tag)
  print(f"devices: {ndev} x {jax.devices()[0].device_kind}; jax {jax.__version__}; counts {counts}",
        flush=True)
  report = {"gpu": gpu, "jax": jax.__version__, "device_kind": jax.devices()[0].device_kind,
            "shape": {"tokens_per_gpu": args.tokens_per_gpu, "d_model": args.d_model,
                      "d_ff": args.d_ff, "experts": args.experts, "top_k": args.top_k,
                      "dtype": args.dtype, "impl": resolve_impl(args.impl)},
            "equivalence": {}, "runs": []}

  for n in counts:
    if n > 1 and not args.skip_equivalence:
      report["equivalence"][n] = equivalence(n, args)
      print(f"equivalence n={n}: {report['equivalence'][n]}", flush=True)

  factors = [None if s.strip().lower() == "none" else float(s) for s in args.buffer_factors.split(",")]
  t, k, d = args.tokens_per_gpu, args.top_k, args.d_model
  for n in counts:
    if time.perf_counter() - START > args.budget_s:
      print(f"time budget spent; skipping n={n}", flush=True)
      continue
    devices = jax.devices()[:n]
    mesh = meshlib.make_expert_mesh(1, n, devices=devices)
    layout = meshlib.expert_layout(mesh, args.experts)
    prob = make_problem(jax.random.key(0), t * n, d, args.d_ff, args.experts, k, dtype, layout=layout)
    variants = []
    if n == 1:
      variants.append(("moe_mlp (1 device)", single_layer(args.impl), None, None, layout, False, None))
      if args.capacity_factor:
        variants.append((f"moe_mlp capacity {args.capacity_factor}",
                         single_layer(args.impl, args.capacity_factor), None, None, layout, False, None))
    else:
      for dispatch in args.dispatches.split(","):
        for bf in factors:  # tokens: T_local rows a peer always; f bounds the rows a receiver computes
          for ex in args.exchanges.split(","):
            cfg = parallel.ExpertParallelConfig(buffer_factor=bf, exchange=ex, dispatch=dispatch)
            variants.append((f"EP dropless {ex} buffer={'safe' if bf is None else bf}"
                             + ("" if dispatch == "assignments" else f" dispatch={dispatch}"),
                             ep_layer(mesh, args.impl, cfg), bf, None, layout, False, cfg.dropless_dispatch))
      if args.capacity_factor:
        variants.append((f"EP capacity {args.capacity_factor}",
                         ep_layer(mesh, args.impl, parallel.ExpertParallelConfig(), args.capacity_factor),
                         None, args.capacity_factor, layout, False, None))
      if n >= 4 and n % 2 == 0:  # SMILE's two-level exchange, groups of n/2 devices standing for hosts
        mesh2 = meshlib.make_expert_mesh(1, n // 2, expert_groups=2, devices=devices)
        cfg2 = parallel.ExpertParallelConfig(expert_axis=(meshlib.EXPERT_GROUP, meshlib.EXPERT),
                                             hierarchical=True, buffer_factor=factors[0])
        variants.append((f"EP dropless hierarchical 2x{n // 2} buffer={factors[0] or 'safe'}",
                         ep_layer(mesh2, args.impl, cfg2), factors[0], None,
                         meshlib.expert_layout(mesh2, args.experts, expert_axis=cfg2.expert_axis), True,
                         cfg2.dropless_dispatch))
    # dispatch: the dropless variants' resolved ExpertParallelConfig.dispatch, which sizes their buffer.
    for name, layer, bf, cf, var_layout, hierarchical, dispatch in variants:
      if time.perf_counter() - START > args.budget_s:
        print(f"time budget spent; skipping {name}", flush=True)
        continue
      step = fwd_bwd(layer)
      (y, _), stats = step(*prob)
      finite = bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
      sec = time_fn(step, *prob, warmup=args.warmup, iters=args.iters)
      run = {"name": name, "gpus": n, "tokens": t * n, "step_ms": sec * 1e3,
             "tokens_per_s": t * n / sec, "finite": finite}
      if n > 1:
        experts_per_peer = args.experts // n
        if cf is not None:
          slots = experts_per_peer * sj.capacity(t, args.experts, k, cf)
        else:
          slots = t if dispatch == "tokens" else parallel.buffer_slots(t, k, n, experts_per_peer, bf)
        ex = "ragged" if cf is None and " ragged " in name else "dense"
        a2a = a2a_time(var_layout, slots, d, dtype, args, prob[1], hierarchical, ex, dispatch or "assignments")
        run.update(slots_per_peer=slots, a2a_ms=a2a * 1e3, a2a_share=4 * a2a / sec,
                   exchange_overflow=int(stats.exchange_overflow),
                   assignments=int(stats.tokens_per_expert.sum()), num_dropped=int(stats.num_dropped))
        if cf is None:  # dropless: every assignment counted, none dropped
          run["dropless_ok"] = run["assignments"] == t * n * k and run["num_dropped"] == 0
      report["runs"].append(run)
      print(json.dumps(run), flush=True)

  base_dropless = next((r for r in report["runs"] if r["name"] == "moe_mlp (1 device)"), None)
  base_capacity = next((r for r in report["runs"] if r["gpus"] == 1 and "capacity" in r["name"]), None)
  for r in report["runs"]:
    b = base_capacity if "capacity" in r["name"] else base_dropless
    r["weak_scaling_efficiency"] = r["tokens_per_s"] / (r["gpus"] * b["tokens_per_s"]) if b else None
  report["elapsed_s"] = time.perf_counter() - START

  os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), exist_ok=True)
  paths = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"expert_parallel_{gpu}.json")]
  if os.environ.get("OUT"):
    paths.append(os.path.join(os.environ["OUT"], f"expert_parallel_{gpu}.json"))
  for path in paths:
    with open(path, "w") as fh:
      json.dump(report, fh, indent=1, default=str)
  print(f"wrote {[os.path.relpath(p) for p in paths]}; {report['elapsed_s']:.0f}s")

  print(f"\n### Expert-parallel MoE fwd+bwd, T={t}/GPU, d={d}, f={args.d_ff}, E={args.experts}, "
        f"top-{k}, {args.dtype}, {report['device_kind']}\n")
  print("| variant | GPUs | step ms | tokens/s | weak-scaling eff. | S/peer | all-to-all ms (x4 share) | overflow |")
  print("|---|---|---|---|---|---|---|---|")
  for r in report["runs"]:
    eff = "" if r["weak_scaling_efficiency"] is None else f"{100 * r['weak_scaling_efficiency']:.1f}%"
    a2a = f"{r['a2a_ms']:.3f} ({100 * r['a2a_share']:.1f}%)" if "a2a_ms" in r else ""
    print(f"| {r['name']} | {r['gpus']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.3g} | {eff} | "
          f"{r.get('slots_per_peer', '')} | {a2a} | {r.get('exchange_overflow', '')} |")
  eq = "; ".join(f"n={n}: " + ", ".join(f"{m} {'ok' if v['ok'] else 'FAIL'} ({v['max_rel_err']:.1e})"
                                         for m, v in e.items()) for n, e in report["equivalence"].items())
  print(f"\nEquivalence vs one device (float32): {eq}")


if __name__ == "__main__":
  main()
