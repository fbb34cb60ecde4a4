"""JAX's own Mosaic GPU grouped matmul, jax.experimental.pallas.ops.gpu.ragged_dot_mgpu (forward only).

It reads the sorted, unpadded rows (tiles that straddle two groups are computed once per group)
and needs K % block_k == 0 and an sm_90 GPU. Its configs are tuned here, per product: each config
of CONFIGS times x @ W_in and gelu(h) @ W_out alone (each checked against the float32 reference);
the expert MLP forward is then timed with the fastest checked config of each product, and that is
the number kept under the variant name jax_ragged_dot_mgpu, with every config's figures beside it.
"""
from __future__ import annotations

import jax

from peers.common import OUT_TOL, Case, Problem, Reference, Timer, compare, rel_err

# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)
CONFIGS = [(64, 128, 64, 4, 1), (128, 128, 64, 4, 2), (128, 128, 64, 5, 4), (128, 128, 64, 3, 1),
           (128, 256, 64, 3, 4), (128, 128, 128, 3, 8), (64, 256, 64, 4, 8)]
FIELDS = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")


def unavailable() -> str | None:
  if jax.default_backend() != "gpu":
    return "ragged_dot_mgpu is GPU-only (no interpret mode); JAX runs on " + jax.default_backend()
  cc = str(getattr(jax.devices()[0], "compute_capability", ""))
  if not cc.startswith("9"):
    return f"ragged_dot_mgpu needs sm_90 (wgmma); this GPU is sm_{cc}"
  try:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: F401
  except ImportError as e:
    return f"not in this jax: {e}"
  return None


def product(cfg):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

  kw = dict(zip(FIELDS, cfg))
  return lambda a, w, gs: ragged_dot_mgpu.ragged_dot(a, w, group_sizes=gs, **kw)


def tune(p: Problem, ref: Reference, timer: Timer, configs=CONFIGS) -> tuple[dict, list[dict]]:
  """The fastest config of each product (checked against the reference), and every config's figures."""
  s = p.shape
  # The second product's input is the reference activation rounded to bf16; its f32 output
  # differs from ref.y by that rounding only (~1e-3).
  a2 = jax.nn.gelu(ref.h).astype(p.rows.dtype)
  products = {"x@Win": (p.rows, p.w_in, ref.h), "h@Wout": (a2, p.w_out, ref.y)}
  flops = 2 * s.N * s.d * s.f
  gs = p.group_sizes
  best, rows = {}, []
  for op, (lhs, rhs, want) in products.items():
    for cfg in configs:
      rec = dict(op=op, config=dict(zip(FIELDS, cfg)))
      try:
        fn = jax.jit(product(cfg))
        err = rel_err(fn(lhs, rhs, gs), want)
        rec["rel_err"] = err
        t = timer(lambda: fn(lhs, rhs, gs), jax.block_until_ready)
        rec.update(ms=t["median_s"] * 1e3, tflops=flops / t["median_s"] / 1e12)
        if err < OUT_TOL and (op not in best or t["median_s"] < best[op][1]):
          best[op] = (cfg, t["median_s"])
      except Exception as e:  # noqa: BLE001 - a config that does not fit is a result
        rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
      rows.append(rec)
  return {op: cfg for op, (cfg, _) in best.items()}, rows


def ragged_dot_mgpu(p: Problem, ref: Reference, timer: Timer, configs=CONFIGS) -> Case:
  best, tried = tune(p, ref, timer, configs)
  if len(best) < 2:
    raise RuntimeError(f"no config of {configs} ran and checked for both products: {tried}")
  mm1, mm2 = product(best["x@Win"]), product(best["h@Wout"])
  fwd = jax.jit(lambda x, w_in, w_out, gs: mm2(jax.nn.gelu(mm1(x, w_in, gs)), w_out, gs))
  args = (p.rows, p.w_in, p.w_out, p.group_sizes)
  return Case("jax_ragged_dot_mgpu", lambda: fwd(*args), None, jax.block_until_ready,
              lambda: compare(fwd(*args), None, ref), p.shape.N,
              {"config": {op: dict(zip(FIELDS, c)) for op, c in best.items()}, "tuning": tried})
