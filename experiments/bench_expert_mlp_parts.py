"""The Mosaic expert MLP on one shape, product by product, beside the peers a user would compare it to.

Times each of the six kernels of the fused expert MLP alone (gmm_act, gmm, gmm_dact, two tgmm,
the transposed gmm; the activation kernels in the forms the MLP runs them, mlp.activation_forms),
then forward+backward of `expert_mlp` fused and unfused (op.gmm with XLA's activation), the
balanced batched-matmul MLP (XLA, E equal groups) and a dense FFN of the same
FLOPs (cuBLAS and XLA's GELU: what dense-XS runs); each MLP returns y beside its gradients, so all
six products run (`fwd_bwd`: until 2026-11-25 these rows timed five). The timer is tune_gmm.timeit (median over
repeats of back-to-back calls after warm-up); useful TFLOP/s count real rows only. The fused MLP's
output is checked against the float32 reference (real rows) and its three gradients against the
unfused path's; the balanced and dense peers are the same FLOPs on other data (plain XLA, bf16 in
and out, so their backward stays bf16), and their gradients are checked against the same
functions on float32 operands. Needs an sm_90 GPU:
  python experiments/bench_expert_mlp_parts.py --shapes XS_b128,E64_top1 [--configs default,epilogue_wg]
--configs times the Mosaic kernels once per config set, in one process (CONFIG_SETS): "default" is
mosaic.DEFAULT_CONFIGS; "planar" runs every gmm kind in planar_snake order (before
expert_band_order); "epilogue_wg" gmm_act and gmm_dact with the epilogue in a fourth warpgroup
(mosaic_epilogue.py); "per_tile", "pingpong" and "tgmm_streamed*" put every tgmm config on one
schedule; "cooperative" puts gmm_act and gmm_dact back on mosaic._gmm_padded's schedule (the
defaults before the ping-pong one), "pingpong_act" runs them on the ping-pong schedule at every
length, "pingpong_all" the plain products too; "dact_cooperative" and "dact_cooperative_256" gmm_dact
alone on the cooperative kernel. A later set's fused gradients are also checked against the first's.
--ab-rounds R times the six kernels and the fused MLP alone (--ab-kernels picks among them), once per
config set, in R interleaved rounds (each set's outputs checked against the first's): for
differences smaller than the drift between sets timed one after the other. A kernel that a set
leaves unchanged is reported as tracing to the first set's program.
Writes expert_mlp_parts.json under $OUT (or the current directory); shapes are tune_gmm.SHAPES.
"""
import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from peers.common import fwd_bwd  # noqa: E402  (y returned beside the gradients: all six products run)
from provenance import source_fingerprint  # noqa: E402
from tune_gmm import problem, rel_err, timeit  # noqa: E402

from sparsejax.activations import DERIVATIVES  # noqa: E402
from sparsejax.kernels.gmm import expert_mlp, mlp_reference, mosaic, mosaic_epilogue  # noqa: E402
from sparsejax.kernels.gmm.mlp import activation_forms  # noqa: E402
from sparsejax.kernels.gmm.reference import real_rows  # noqa: E402


GMM_KINDS = ("gmm", "gmm_t", "gmm_act", "gmm_dact", "gmm_glu", "gmm_glu_short", "gmm_dglu")


def _tgmm_set(**changes) -> dict:
  """Both tgmm kinds of DEFAULT_CONFIGS with `changes`, as a config set."""
  c = mosaic.DEFAULT_CONFIGS.with_tgmm(**changes)
  return dict(tgmm=c.tgmm, tgmm_long=c.tgmm_long, tgmm_short=c.tgmm_short)


# The ping-pong schedule (mosaic_pingpong.gmm_padded) as Configs.gmm_act has it; fit_gmm gives
# gmm_dact 4 of the 6 slots.
_PINGPONG = mosaic.Config(pingpong=True, tile_n=128, tile_k=64, max_concurrent_steps=6, epi_tile_n=32,
                          grid_tile_width=8, expert_bands=True)


CONFIG_SETS = {
    "default": {},
    # Every gmm kind in planar_snake order over all row blocks (before expert_band_order).
    "planar": {k: dataclasses.replace(getattr(mosaic.DEFAULT_CONFIGS, k), expert_bands=False) for k in GMM_KINDS},
    "epilogue_wg": mosaic_epilogue.CONFIGS,
    # gmm_act alone with the epilogue warpgroup at every row count (the default takes it from
    # LONG_ROWS rows an expert: Configs.gmm_act_long), and the cooperative kernel at every count.
    "epilogue_wg_act": dict(gmm_act=mosaic_epilogue.CONFIGS["gmm_act"]),
    "cooperative_act": dict(gmm_act=mosaic.COOPERATIVE_ACT, gmm_act_long=mosaic.COOPERATIVE_ACT),
    # gmm_act and gmm_dact on mosaic._gmm_padded's cooperative schedule below LONG_ROWS rows an
    # expert: the defaults before the ping-pong kernel.
    "cooperative": dict(gmm_act=mosaic.COOPERATIVE_ACT, gmm_dact=mosaic.COOPERATIVE_DACT),
    # tgmm's schedules: the per-tile pipeline (a 4-deep ring, 2 store slots of 32 columns), the
    # ping-pong one (mosaic_pingpong.py), one ring for all of a CTA's tiles (_tgmm_streamed: 3
    # deep, a consumer's whole tile staged for its stores; or 4 deep and 2 slots; or 64-wide slots).
    "per_tile": _tgmm_set(streamed=False, pingpong=False),
    "pingpong": _tgmm_set(streamed=False, pingpong=True),
    "tgmm_streamed": _tgmm_set(streamed=True, pingpong=False, max_concurrent_steps=3, epi_slots=4),
    "tgmm_streamed_ring4": _tgmm_set(streamed=True, pingpong=False, max_concurrent_steps=4, epi_slots=2),
    # gmm_act and gmm_dact (their _long configs too) on the ping-pong schedule; and the plain
    # products (h W_out, dX) too, 128 x 128 tiles against their cooperative 128 x 256 (not measured).
    "pingpong_act": dict.fromkeys(("gmm_act", "gmm_act_long", "gmm_dact", "gmm_dact_long"), _PINGPONG),
    "pingpong_all": dict.fromkeys(("gmm", "gmm_t", "gmm_act", "gmm_act_long", "gmm_dact", "gmm_dact_long"),
                                  _PINGPONG),
    # gmm_act's ping-pong tiles in bands of 4 row blocks (0.308 against 0.322 ms at E64 top-1 in one
    # sweep, equal at E64 top-8: results/act_kernels_pingpong_H200.log; in 3 interleaved rounds on
    # an H100 gmm_act and the MLP tied at E64 top-1, skewed or not: results/dact_schedules_ab_H100.log).
    "pingpong_act_bands4": dict(gmm_act=dataclasses.replace(_PINGPONG, grid_tile_width=4)),
    "tgmm_streamed_epi64": _tgmm_set(streamed=True, pingpong=False, max_concurrent_steps=3, epi_tile_n=64, epi_slots=2),
    # The plain products alone (h W_out, dX) on the ping-pong schedule: tied on the skewed E64 top-1,
    # lost on E64 top-1 and E8 top-2 (results/probe_gmm_waves_H100.log).
    "pingpong_plain": dict.fromkeys(("gmm", "gmm_t"), _PINGPONG),
    # The plain products (h W_out, dX) with the last wave of their persistent loop cut into half- or
    # quarter-width pieces (Config.split_tail), and without it.
    "split_tail": {k: dataclasses.replace(getattr(mosaic.DEFAULT_CONFIGS, k), split_tail=True) for k in ("gmm", "gmm_t")},
    "whole_tail": {k: dataclasses.replace(getattr(mosaic.DEFAULT_CONFIGS, k), split_tail=False) for k in ("gmm", "gmm_t")},
    # gmm_dact alone on the cooperative kernel (128- or 256-wide tiles): its epilogue, a multiply by
    # the saved act'(pre) since gmm_act stores it, is lighter than when the ping-pong kernel won.
    # On E64 top-1 (skewed and not) 128-wide lost 3-4%, 256-wide tied, and the MLP tied
    # (results/dact_schedules_ab_H100.log).
    "dact_cooperative": dict(gmm_dact=mosaic.COOPERATIVE_DACT),
    "dact_cooperative_256": dict(gmm_dact=dataclasses.replace(mosaic.COOPERATIVE_DACT, tile_n=256, max_concurrent_steps=4)),
    # The defaults again, as a set of their own: in one process the first set profiled read 5-30%
    # slow (probe_gmm_waves.py), so a second copy measured after the others shows the drift.
    "default_again": {},
}


@contextlib.contextmanager
def config_set(name: str):
  """mosaic.DEFAULT_CONFIGS with CONFIG_SETS[name] while the kernels are traced, then as it was."""
  default = mosaic.DEFAULT_CONFIGS
  mosaic.DEFAULT_CONFIGS = dataclasses.replace(default, **CONFIG_SETS[name])
  try:
    yield
  finally:
    mosaic.DEFAULT_CONFIGS = default


def parts(shape: str, config_sets=("default",)) -> dict:
  """The six kernels and the MLP per config set; a later set's fused gradients are also checked
  against the first's."""
  out, first = {}, None
  for i, name in enumerate(config_sets):
    with config_set(name):
      out[name], grads = config_set_parts(shape, peers=i == 0, tag=name, first=first)
    first = first or grads
    _report(f"{shape} {name}", out[name])
  return out


def config_set_parts(shape: str, peers: bool, tag: str, first=None) -> tuple[dict, tuple]:
  p = problem(shape)
  topo, x, w_in, w_out = p["topo"], p["x"], p["w_in"], p["w_out"]
  n, d, e = p["N"], p["d"], p["E"]
  flops = 2 * n * d * p["f"]
  act = jax.nn.gelu
  real = real_rows(topo)[:, None]
  res = {}

  def rec(name, fn, args, f):
    out = jax.block_until_ready(fn(*args))
    t = timeit(fn, *args)
    res[name] = dict(ms=t * 1e3, tflops=f / t / 1e12)
    print(f"{shape} {tag:11s} {name:38s} {t * 1e3:7.3f} ms {f / t / 1e12:6.1f} TF/s", flush=True)
    return out

  # The forms the fused MLP runs at this size: pre is act'(pre) where gmm_act saves the derivative.
  fwd_act, bwd_act = activation_forms(act, x.shape[0], e)
  pre, h = rec("gmm_act x W_in -> (pre, h)", jax.jit(lambda a, b: mosaic.gmm_act(a, b, topo, fwd_act)), (x, w_in),
               flops)
  y = rec("gmm h W_out", jax.jit(lambda a, b: mosaic.gmm(a, b, topo, False, a.dtype)), (h, w_out), flops)
  dy = jnp.where(real, jax.random.normal(jax.random.key(9), y.shape, y.dtype), 0)
  dpre = rec("gmm_dact dY W_out^T * act'(pre)",
             jax.jit(lambda a, b, c: mosaic.gmm_dact(a, b, topo, c, bwd_act)), (dy, w_out, pre), flops)
  tg = jax.jit(lambda a, b: mosaic.tgmm(a, b, topo, a.dtype))
  rec("tgmm h^T dY (dW_out)", tg, (h, dy), flops)
  rec("tgmm x^T dpre (dW_in)", tg, (x, dpre), flops)
  rec("gmm_t dpre W_in^T (dx)", jax.jit(lambda a, b: mosaic.gmm(a, b, topo, True, a.dtype)), (dpre, w_in), flops)
  res["sum of the six kernels"] = dict(ms=sum(r["ms"] for r in res.values()))

  def mlp_grad(activation):
    return jax.jit(fwd_bwd(lambda a, wi, wo: expert_mlp(a, wi, wo, topo, activation=activation, backend="mosaic"), dy))

  _, fused = rec("expert_mlp fused fwd+bwd", mlp_grad(act), (x, w_in, w_out), 6 * flops)
  # A lambda is not in mlp.FUSED: op.gmm products with XLA's activation between them.
  _, unfused = rec("expert_mlp unfused fwd+bwd", mlp_grad(lambda v: jax.nn.gelu(v)), (x, w_in, w_out), 6 * flops)
  on_real = lambda v: jnp.where(real, v, 0)
  y_ref = jax.jit(lambda a, wi, wo: mlp_reference(a, wi, wo, topo, act))(x, w_in, w_out)
  res["fused_y_vs_reference_rel_err"] = rel_err(on_real(y), on_real(y_ref))
  res["fused_vs_unfused_grad_rel_err"] = [
      rel_err(on_real(fused[0]), on_real(unfused[0])), rel_err(fused[1], unfused[1]), rel_err(fused[2], unfused[2])]
  if first is not None:
    res["fused_grad_vs_first_set_rel_err"] = [
        rel_err(on_real(fused[0]), on_real(first[0])), rel_err(fused[1], first[1]), rel_err(fused[2], first[2])]

  if not peers:
    return res, fused
  xb, dyb = x[:n].reshape(e, n // e, d), dy[:n].reshape(e, n // e, d)
  bal = fwd_bwd(lambda a, wi, wo: jnp.einsum("ecf,efd->ecd", act(jnp.einsum("ecd,edf->ecf", a, wi)), wo), dyb)
  dense = fwd_bwd(lambda a, wi, wo: act(a @ wi) @ wo, dy[:n])
  f32 = lambda args: tuple(a.astype(jnp.float32) for a in args)
  for name, fn, args in (("balanced bmm MLP fwd+bwd", bal, (xb, w_in, w_out)),
                         ("dense FFN fwd+bwd (cuBLAS, XLA GELU)", dense, (x[:n], w_in[0], w_out[0]))):
    grad = jax.jit(fn)
    _, got = rec(name, grad, args, 6 * flops)
    # Each peer's three gradients against the same function on float32 operands.
    res[name]["grad_vs_float32_rel_err"] = [rel_err(g, w) for g, w in zip(got, grad(*f32(args))[1], strict=True)]
    print(f"{shape} {name} dx, dW_in, dW_out vs float32 rel err "
          f"{', '.join(f'{v:.1e}' for v in res[name]['grad_vs_float32_rel_err'])}", flush=True)
  return res, fused


AB_KERNELS = ("gmm_act", "gmm h W_out", "gmm_dact", "tgmm h^T dY", "tgmm x^T dpre", "gmm_t dX",
              "expert_mlp fwd+bwd")


def ab(shape: str, config_sets, rounds: int, names=AB_KERNELS) -> dict:
  """The kernels `names` (of AB_KERNELS; the MLP is the fused fwd+bwd) compiled once per config
  set, then timed in `rounds` interleaved rounds (set A, set B, A, B, ...), so that clock drift
  over the run, which moved one unchanged kernel by 15% between two sets timed one after the
  other, falls on every set alike. Each set's outputs are checked against the first set's (the
  tgmm gradients are the same sums in the same order, so they should agree bit for bit).
  {kernel: {set: [ms per round]}}."""
  p = problem(shape)
  topo, x, w_in, w_out = p["topo"], p["x"], p["w_in"], p["w_out"]
  act, real = jax.nn.gelu, real_rows(topo)[:, None]
  dy = jnp.where(real, jax.random.normal(jax.random.key(9), (x.shape[0], w_out.shape[-1]), x.dtype), 0)
  pre, h = jax.jit(lambda a, b: mosaic.gmm_act(a, b, topo, act))(x, w_in)
  dpre = jax.jit(lambda a, b, c: mosaic.gmm_dact(a, b, topo, c, act))(dy, w_out, pre)
  # gmm_dact's input in either form the sets may run it in: pre, or act'(pre) (zero off the real rows).
  saved = {act: pre, None: jnp.where(real, DERIVATIVES[act](pre.astype(jnp.float32)), 0).astype(pre.dtype)}
  forms = {}

  def kernels(name):
    # Fresh functions per config set: jit caches a trace by function identity, so reusing one
    # function object would run the first set's trace (its configs) for every later set. Each
    # set's activation kernels run in the forms the fused MLP takes under its configs.
    fwd_act, bwd_act = forms.setdefault(name, activation_forms(act, x.shape[0], topo.num_experts))
    tg = lambda a, b: mosaic.tgmm(a, b, topo, a.dtype)
    every = {"gmm_act": (lambda a, b: mosaic.gmm_act(a, b, topo, fwd_act), (x, w_in)),
             "gmm h W_out": (lambda a, b: mosaic.gmm(a, b, topo, False, a.dtype), (h, w_out)),
             "gmm_dact": (lambda a, b, c: mosaic.gmm_dact(a, b, topo, c, bwd_act), (dy, w_out, saved[bwd_act])),
             "tgmm h^T dY": (tg, (h, dy)),
             "tgmm x^T dpre": (tg, (x, dpre)),
             "gmm_t dX": (lambda a, b: mosaic.gmm(a, b, topo, True, a.dtype), (dpre, w_in)),
             "expert_mlp fwd+bwd": (fwd_bwd(lambda a, wi, wo: expert_mlp(
                 a, wi, wo, topo, activation=act, backend="mosaic"), dy), (x, w_in, w_out))}
    return {k: every[k] for k in names}

  compiled, outs, programs, args_of = {}, {}, {}, {}
  for name in config_sets:
    with config_set(name):
      for k, (fn, args) in kernels(name).items():
        args_of[k, name] = args
        compiled[k, name] = jax.jit(fn).lower(*args).compile()
        # The traced program, not the compiled text: Mosaic GPU's compiled text differs between
        # two compiles of the same kernel.
        programs[k, name] = str(jax.make_jaxpr(fn)(*args))
        outs[k, name] = jax.block_until_ready(compiled[k, name](*args))
  res = {"rel_err_vs_first": {}, "same_program_as_first": {}, "ms": {k: {c: [] for c in config_sets} for k in names}}
  on_real = lambda v: jnp.where(real, v, 0) if v.shape[0] == x.shape[0] else v
  for k in names:
    for c in config_sets[1:]:
      # A set that traces to the first's program measures nothing: say so beside its times.
      res["same_program_as_first"][f"{k} {c}"] = programs[k, c] == programs[k, config_sets[0]]
      pairs = list(zip(jax.tree.leaves(outs[k, c]), jax.tree.leaves(outs[k, config_sets[0]]), strict=True))
      if k == "gmm_act" and forms[c] != forms[config_sets[0]]:
        pairs = pairs[1:]  # one set's first output is pre, the other's act'(pre): compare act(pre) only
      res["rel_err_vs_first"][f"{k} {c}"] = [rel_err(on_real(a), on_real(b)) for a, b in pairs]
  for _ in range(rounds):
    for k in names:
      for c in config_sets:
        res["ms"][k][c].append(1e3 * timeit(compiled[k, c], *args_of[k, c]))
  for k in names:
    print(f"{shape} A/B {k:20s} " + "   ".join(
        f"{c} median {statistics.median(v):.3f} ms (min {min(v):.3f}, max {max(v):.3f})"
        for c, v in res["ms"][k].items()), flush=True)
  print(f"{shape} A/B rel err against {config_sets[0]}: " + "; ".join(
      f"{k} {', '.join(f'{e:.1e}' for e in v)}" for k, v in res["rel_err_vs_first"].items()), flush=True)
  same = [k for k, v in res["same_program_as_first"].items() if v]
  if same:
    print(f"{shape} A/B traced to the first set's program (no difference to measure): {'; '.join(same)}",
          flush=True)
  return res


def _report(shape, res):
  print(f"{shape} fused y vs reference rel err {res['fused_y_vs_reference_rel_err']:.1e}; fused vs unfused "
        f"dx, dW_in, dW_out rel err {', '.join(f'{e:.1e}' for e in res['fused_vs_unfused_grad_rel_err'])}"
        + (f"; against the first config set {', '.join(f'{e:.1e}' for e in res['fused_grad_vs_first_set_rel_err'])}"
           if "fused_grad_vs_first_set_rel_err" in res else ""), flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="XS_b128,E64_top1")
  ap.add_argument("--configs", default="default", help=f"comma-separated, of {', '.join(CONFIG_SETS)}")
  ap.add_argument("--ab-rounds", type=int, default=0,
                  help="instead of the parts: --ab-kernels per config set, in this many interleaved rounds")
  ap.add_argument("--ab-kernels", default=",".join(AB_KERNELS), help=f"comma-separated, of {', '.join(AB_KERNELS)}")
  args = ap.parse_args(argv)
  config_sets = args.configs.split(",")
  if any(s not in CONFIG_SETS for s in config_sets):
    ap.error(f"--configs: each one of {', '.join(CONFIG_SETS)}")
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; sparsejax source {source_fingerprint()}",
        flush=True)
  if args.ab_rounds:
    names = args.ab_kernels.split(",")
    if any(k not in AB_KERNELS for k in names):
      ap.error(f"--ab-kernels: each one of {', '.join(AB_KERNELS)}")
    out = {s: ab(s, config_sets, args.ab_rounds, names) for s in args.shapes.split(",")}
  else:
    out = {s: parts(s, config_sets) for s in args.shapes.split(",")}
  with open(os.path.join(os.environ.get("OUT", "."), "expert_mlp_parts.json"), "w") as fh:
    json.dump(out, fh, indent=1)


if __name__ == "__main__":
  main()
