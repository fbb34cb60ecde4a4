"""Where the skewed E64 top-1 shape's extra expert-MLP time goes: gmm's tile waves, the cost of a
light tile, and each kernel's device time inside the MLP under other schedules or tile orders.

gmm's persistent loop gives step i to SM i % num_sms and a CTA works its tiles in turn, so a kernel
lasts about as long as its busiest SM's tiles: a last wave of a few tiles costs a whole tile time.

--model (CPU): on bench_moe_layer's routing of the E64 top-1 shapes (the expert-MLP table's ids and
  the layer's router), each gmm kind's tile grid (expert_band_order): active tiles, light ones (a
  row block with at most 64 real rows) and the busiest SM's load in full-tile units, for a light
  tile costing h of a full one, in expert_band_order and with every second full wave reversed.
--in-mlp SHAPES --configs SETS (GPU): bench_moe_layer's sparsejax_pallas MLP case (its placement,
  its routing) under each config set of bench_expert_mlp_parts.CONFIG_SETS; a "+rev" suffix
  reverses every second full wave of the gmm kinds' tile orders. Every set's outputs are checked
  against the first's on the real rows; then --rounds interleaved timer rounds of fwd+bwd, and one
  profile a set (after one unread trace: a process's first reads its kernels slow): each kernel's
  device time inside the MLP. Shapes "u<rows>": 64 experts of <rows> rows each at E64 top-1's d, f.
--light-cost (GPU): h measured, as --in-mlp on u576 (four full blocks and a light one an expert)
  and u640 (five full): with 5 blocks an expert and 132 SMs, each SM's tiles take every residue
  mod 5 alike, so the busiest SM runs 8 full + 2 light tiles against 10 full: h = 5 t576 / t640 - 4.

  python experiments/probe_gmm_waves.py --model
  python experiments/probe_gmm_waves.py --in-mlp E64_top1,E64_top1_skewed \
      --configs default,pingpong_plain,default_again,pingpong_plain+rev
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import statistics
import sys
import tempfile

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_expert_mlp_parts as parts  # noqa: E402
import bench_moe_layer  # noqa: E402
from peers import common, layer, sparsejax_variants  # noqa: E402
from sparsejax import permute  # noqa: E402
from sparsejax.kernels.gmm import mosaic  # noqa: E402
from sparsejax.topology import BLOCK_SIZE  # noqa: E402

NUM_SMS = 132  # an H100's; --in-mlp reads the GPU's own
SHAPES = {s.name: s for s in bench_moe_layer.SHAPES + bench_moe_layer.SMOKE_SHAPES}
# gmm kinds of the E64 top-1 MLP: (N tiles a row block, band width) under the defaults, and the
# ping-pong schedule's 128-wide tiles (two tiles of a CTA in flight, so loads count half).
GRIDS = {"gmm h W_out (N 1024 / 256)": (4, 8, 1.0), "gmm_t dX (N 4096 / 256)": (16, 4, 1.0),
         "ping-pong gmm (N 1024 / 128)": (8, 8, 0.5), "ping-pong gmm_act, gmm_t (N 4096 / 128)": (32, 8, 0.5)}


def busiest_sm_load(order, row_block_rows, n_iters: int, num_sms: int, h: float) -> tuple[float, float]:
  """(busiest SM's load, mean load) in full-tile units: step i runs tile order[i] on SM i % num_sms;
  a tile of a block with more than 64 real rows costs 1, one with 1-64 costs h, inactive ones 0."""
  real = np.asarray(row_block_rows)[np.asarray(order) // n_iters]
  cost = np.where(real > BLOCK_SIZE // 2, 1.0, np.where(real > 0, h, 0.0))
  loads = np.zeros(num_sms)
  np.add.at(loads, np.arange(len(cost)) % num_sms, cost)
  return float(loads.max()), float(cost.sum() / num_sms)


def reversed_waves(order, num_sms: int):
  """order with every second full wave of num_sms steps backwards (tgmm's _tgmm_item, for gmm)."""
  return order[mosaic._tgmm_item(jnp.arange(order.shape[0], dtype=jnp.int32), order.shape[0], num_sms)]


def topology(ids, num_experts):
  return sparsejax_variants.topology(permute.dropless_placement(ids, num_experts, block_size=BLOCK_SIZE))


def bench_topologies(names) -> dict:
  """{"<shape> mlp" / "<shape> layer": topology} from the two routings bench_moe_layer uses."""
  out = {}
  for name in names:
    s = SHAPES[name]
    out[f"{name} mlp"] = topology(common.make_problem(s).ids, s.E)
    a = layer.inputs(s)
    routing, _, _ = layer.functions(s, "auto", None)
    out[f"{name} layer"] = topology(routing(a["x"], a["bias"], a["w_r"]).expert_ids, s.E)
  return out


def model(names=("E64_top1", "E64_top1_skewed"), hs=(1.0, 0.8), num_sms=NUM_SMS) -> list[str]:
  lines = []
  for name, t in bench_topologies(names).items():
    rbr = np.asarray(t.row_block_rows)
    active = int(np.asarray(t.expert_block_offsets)[-1])
    light = int(np.sum((rbr > 0) & (rbr <= BLOCK_SIZE // 2)))
    lines.append(f"{name}: {active} active row blocks, {light} light")
    for kind, (n_iters, width, scale) in GRIDS.items():
      order = mosaic.expert_band_order(t.row_block_expert, t.expert_block_offsets, n_iters, width)
      cells = []
      for h in hs:
        band, mean = busiest_sm_load(order, rbr, n_iters, num_sms, h)
        rev, _ = busiest_sm_load(reversed_waves(order, num_sms), rbr, n_iters, num_sms, h)
        cells.append(f"h={h:g}: {scale * band:.2f} (reversed waves {scale * rev:.2f}, mean {scale * mean:.2f})")
      lines.append(f"  {kind:42s} {active * n_iters:5d} tiles  " + "  ".join(cells))
  return lines


@contextlib.contextmanager
def config_set(name: str):
  """bench_expert_mlp_parts.config_set, and with "+rev" every gmm kind's order in reversed waves."""
  base, _, rev = name.partition("+")
  if rev not in ("", "rev"):
    raise ValueError(f"config set suffix: +rev or none; got {name!r}")
  band = mosaic.expert_band_order
  if rev:
    mosaic.expert_band_order = lambda *a: reversed_waves(band(*a), mosaic._num_sms())
  try:
    with parts.config_set(base):
      yield
  finally:
    mosaic.expert_band_order = band


def uniform_problem(rows: int, d=1024, f=4096, experts=64) -> common.Problem:
  s = common.Shape(f"u{rows}", experts * rows, d, f, experts, 1, False)
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (s.T, d), jnp.bfloat16)
  w_in = (jax.random.normal(keys[1], (experts, d, f)) / d ** 0.5).astype(jnp.bfloat16)
  w_out = (jax.random.normal(keys[2], (experts, f, d)) / f ** 0.5).astype(jnp.bfloat16)
  counts = jnp.full((experts,), rows, jnp.int32)
  ids = jnp.repeat(jnp.arange(experts, dtype=jnp.int32), rows)[:, None]  # sorted: rows are x itself
  return common.Problem(s, x, ids, w_in, w_out, np.asarray(counts), x,
                        jax.random.normal(keys[3], (s.T, d), jnp.bfloat16), counts)


def kernel_ms(case, calls=5) -> dict[str, float]:
  """{kernel name: device ms per call} of `calls` traced fwd+bwd calls."""
  tmp = tempfile.mkdtemp(prefix="probe_gmm_waves_")
  try:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(calls):
        out = case.fwdbwd()
      jax.block_until_ready(out)
    total, _, _, _ = layer.trace_device_times(glob.glob(f"{tmp}/**/perfetto_trace.json.gz", recursive=True)[0])
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  kernels = total.get("GPU kernels (all streams)", total.get("CPU events", {}))
  return {k: us / calls / 1e3 for k, us in kernels.items()}


def in_mlp(name: str, sets: list[str], rounds: int, timer=common.Timer(), calls=5) -> dict:
  """{"ms": {set: [fwd+bwd ms a round]}, "kernels": {set: {kernel: ms}}, "rel_err": {set: [...]}}."""
  p = uniform_problem(int(name[1:])) if name.startswith("u") else common.make_problem(SHAPES[name])
  placement, _, pos = sparsejax_variants.padded_layout(p)
  real = lambda a: a[pos] if a.shape[0] == placement.num_rows else a  # unwritten rows differ
  cases, outs = {}, {}
  for cs in sets:
    with config_set(cs):  # traced and compiled here, under the set's configs
      cases[cs] = sparsejax_variants.sparsejax_case(p, None, "pallas")
      outs[cs] = jax.tree.leaves(jax.block_until_ready(cases[cs].fwdbwd()))
  res = {"rel_err": {cs: [common.rel_err(real(a), real(b)) for a, b in zip(outs[cs], outs[sets[0]])]
                     for cs in sets}, "ms": {cs: [] for cs in sets}, "kernels": {}}
  for cs in sets:
    print(f"{name} {cs}: outputs against {sets[0]}'s on the real rows, rel err "
          + " ".join(f"{e:.1e}" for e in res["rel_err"][cs]), flush=True)
  for _ in range(rounds):
    for cs, c in cases.items():
      res["ms"][cs].append(timer(c.fwdbwd, jax.block_until_ready)["median_s"] * 1e3)
  # The first trace of a process reads its kernels 5-30% slow (seen on an H100: the same program
  # traced again, or the same kernel in the next set, ran faster), so one trace goes unread.
  kernel_ms(cases[sets[0]], 1)
  for cs, c in cases.items():
    res["kernels"][cs] = kernel_ms(c, calls)
    ks = sorted(res["kernels"][cs].items(), key=lambda kv: -kv[1])[:6]
    print(f"{name} {cs:22s} fwd+bwd median {statistics.median(res['ms'][cs]):.3f} ms (rounds "
          + " ".join(f"{v:.3f}" for v in res["ms"][cs]) + "); in the MLP: "
          + ", ".join(f"{k.replace('sparsejax_', '').replace('_mosaic_gpu_kernel', '')} {v:.3f}" for k, v in ks),
          flush=True)
  return res


def light_cost(sets: list[str], rounds: int) -> dict[str, dict[str, float]]:
  """h = 5 t(u576) / t(u640) - 4 per set and kernel, from the kernels' device times in the MLP."""
  a, b = in_mlp("u576", sets, rounds), in_mlp("u640", sets, rounds)
  out = {}
  for cs in sets:
    out[cs] = {k: 5 * a["kernels"][cs][k] / b["kernels"][cs][k] - 4
               for k in a["kernels"][cs] if k in b["kernels"][cs] and b["kernels"][cs][k] > 0.05}
    print(f"light tile cost h, {cs}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(out[cs].items())), flush=True)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", action="store_true")
  ap.add_argument("--in-mlp", default="", help="comma-separated shapes (bench_moe_layer's, or u<rows>)")
  ap.add_argument("--light-cost", action="store_true")
  ap.add_argument("--configs", default="default,pingpong_plain")
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args(argv)
  sets = args.configs.split(",")
  unknown = [s for s in sets if s.partition("+")[0] not in parts.CONFIG_SETS or s.partition("+")[2] not in ("", "rev")]
  if unknown:
    ap.error(f"--configs: {unknown}; each of {', '.join(parts.CONFIG_SETS)}, optionally with +rev")
  shapes = [s for s in args.in_mlp.split(",") if s]
  bad = [s for s in shapes if s not in SHAPES and not (s.startswith("u") and s[1:].isdigit())]
  if bad:
    ap.error(f"--in-mlp: unknown shapes {bad}; choose from {sorted(SHAPES)} or u<rows>")
  if not (args.model or shapes or args.light_cost):
    ap.error("nothing to do: --model, --in-mlp SHAPES or --light-cost")
  if args.model:
    print("\n".join(model()), flush=True)
  for s in shapes:
    in_mlp(s, sets, args.rounds)
  if args.light_cost:
    light_cost(sets, args.rounds)


if __name__ == "__main__":
  main()
