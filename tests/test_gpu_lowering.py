"""The Pallas kernels (Triton, and Mosaic GPU for Hopper) lower for a GPU, checked from the CPU.

Interpret mode runs a kernel's jaxpr with XLA's CPU ops, so it cannot tell whether Triton lowers every
primitive a kernel body uses (a sort, an erf, a reshape of a loaded block would pass here and fail on
the first GPU call), nor whether Mosaic GPU finds wgmma layouts for a kernel's tiles. jax lowers for a
platform it does not run on (lowering_platforms), so each kernel is lowered for CUDA here; compiling
and running them is tests_gpu/'s and the GPU runs of tests/.
"""
import jax
import jax.numpy as jnp
import pytest

from sparsejax.activations import PLAIN
from sparsejax.kernels.block_rounding import triton as block_rounding
from sparsejax.kernels.decode_attention import triton as attention
from sparsejax.kernels.decode_qkv import triton as qkv
from sparsejax.kernels.decode_router import triton as router
from sparsejax.kernels.group_rows import triton as group_rows
from sparsejax.kernels.pallas_triton_gpu import lower_for_gpu
from sparsejax.kernels.row_moves import triton as row_moves
from sparsejax.kernels.skinny_matmul import triton as skinny
from sparsejax.kernels.skinny_matmul import triton_row_ffn as row_ffn
from sparsejax.rope import inverse_frequencies

bf16 = jnp.bfloat16


def _lowers(fn, *shapes, triggers="all"):
  """fn lowers for CUDA with one Triton custom call or more. triggers: how many of its kernels let the next kernel
  launch first (launch_dependents; the decode step's small kernels do, the weight-streaming products and the
  training kernels do not), "all" or an int."""
  args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  text = lower_for_gpu(fn, *args).as_text()
  kernels = text.count("xla.gpu.triton")
  assert kernels >= 1
  assert text.count("griddepcontrol.launch_dependents") == (kernels if triggers == "all" else triggers)


def _hidden_ffn(m, d, f, act, gated, scaled):
  """W_in (and W_gate) as parts with the norm folded, then W_out taking them as its Hidden rows."""
  ci, co = skinny.default_config(m, d, f), skinny.default_config(m, f, d)
  hidden = skinny.Hidden(PLAIN[act], jnp.dtype(bf16), d // ci.rows_per_program, scaled, gated, scaled)

  def fn(x, g, w_in, w_gate, s, w_out, ids):
    first = lambda w: skinny.skinny_matmul_parts((x, g), skinny.Normed(1e-6), w, ids, m, bf16, ci, interpret=False)
    ops = (first(w_in),) + ((s,) if scaled else ())
    if gated:
      ops += (first(w_gate),) + ((s,) if scaled else ())
    return skinny.skinny_matmul_parts(ops, hidden, w_out, ids, m, bf16, co, interpret=False)

  wdt = jnp.int8 if scaled else bf16
  return fn, ((m, d), bf16), ((d,), jnp.float32), ((4, d, f), wdt), ((4, d, f), wdt), ((4, f), jnp.float32), \
      ((4, f, d), wdt), ((2,), jnp.int32)


@pytest.mark.parametrize("act", [jax.nn.gelu, jax.nn.silu, jax.nn.relu], ids=["gelu", "silu", "relu"])
@pytest.mark.parametrize("m,d,f", [(1, 1024, 4096), (1, 256, 512), (5, 256, 512)])
def test_skinny_ffn_kernels_lower(act, m, d, f):
  for gated, scaled in [(False, False), (True, True)]:
    fn, *shapes = _hidden_ffn(m, d, f, act, gated, scaled)
    _lowers(fn, *shapes, triggers=0)


@pytest.mark.parametrize("act", [jax.nn.gelu, jax.nn.silu, jax.nn.relu], ids=["gelu", "silu", "relu"])
def test_row_ffn_kernel_lowers(act):
  """The one-kernel one-row feed-forward: bf16 with the norm folded (medium's d 1,024, f 4,096), int8 GLU with
  scales, and a row per slot."""
  f, g = PLAIN[act], jnp.float32
  fn = lambda x, ns, w_in, w_out, ids: row_ffn.row_ffn_parts((x, ns), skinny.Normed(1e-6), w_in, None, w_out, None,
                                                              None, ids, f, bf16, interpret=False)
  _lowers(fn, ((1, 1024), bf16), ((1024,), g), ((4, 1024, 4096), bf16), ((4, 4096, 1024), bf16), ((1,), jnp.int32),
          triggers=0)
  fn = lambda x, w_in, w_gate, w_out, s, ids: row_ffn.row_ffn_parts((x,), skinny.Plain(True), w_in, w_gate, w_out, s,
                                                                     s, ids, f, bf16, interpret=False)
  i8 = jnp.int8  # int8 weights are k-major: W_in and W_gate [E, f, d], W_out [E, d, f]
  _lowers(fn, ((2, 1, 512), bf16), ((4, 2048, 512), i8), ((4, 2048, 512), i8), ((4, 512, 2048), i8), ((4, 2048), g),
          ((2,), jnp.int32), triggers=0)


def test_row_ffn_residual_epilogue_lowers():
  """The row form's parts summed, combined and added to the residual: medium's 128 parts of one slot, and two
  slots with int8's output scales and a float32 residual."""
  g = jnp.float32
  fn = lambda p, c, r, ids: row_ffn.residual_epilogue(p, c, r, None, ids, bf16, 8, interpret=False)
  _lowers(fn, ((1, 128, 1024), g), ((1, 1), g), ((1, 1024), bf16), ((1,), jnp.int32))
  fn = lambda p, c, r, s, ids: row_ffn.residual_epilogue(p, c, r, s, ids, bf16, 8, interpret=False)
  _lowers(fn, ((2, 64, 512), g), ((1, 2), g), ((1, 512), g), ((8, 512), g), ((2,), jnp.int32))


@pytest.mark.parametrize("k", [1, 2])
def test_routed_row_ffn_and_epilogue_lower(k):
  """The row kernel selecting the token's experts and weights from the router's partial logits (medium's 8 splits
  of 64 experts), then the epilogue: top-1 in bf16 with the norm folded, top-2 renormalized on int8 GLU weights."""
  g, i8, f = jnp.float32, jnp.int8, PLAIN[jax.nn.gelu]

  def top1(x, ns, w_in, w_out, rp, r):
    parts, ids, wts = row_ffn.row_ffn_parts((x, ns), skinny.Normed(1e-6), w_in, None, w_out, None, None, rp, f, bf16,
                                            row_ffn.Routed(1, False), interpret=False)
    return row_ffn.residual_epilogue(parts, wts[None], r, None, ids, bf16, 64, interpret=False)

  def top2(x, w_in, w_gate, w_out, s, so, rp, r):
    parts, ids, wts = row_ffn.row_ffn_parts((x,), skinny.Plain(False), w_in, w_gate, w_out, s, s, rp, f, bf16,
                                            row_ffn.Routed(2, True), interpret=False)
    return row_ffn.residual_epilogue(parts, wts[None], r, so, ids, bf16, 8, interpret=False)

  if k == 1:
    _lowers(top1, ((1, 1024), bf16), ((1024,), g), ((64, 1024, 4096), bf16), ((64, 4096, 1024), bf16),
            ((1, 8, 64), g), ((1, 1024), bf16), triggers=1)
  else:
    _lowers(top2, ((1, 512), bf16), ((8, 2048, 512), i8), ((8, 2048, 512), i8), ((8, 512, 2048), i8),  # k-major
            ((8, 2048), g), ((8, 512), g), ((1, 4, 8), g), ((1, 512), g), triggers=1)


@pytest.mark.parametrize("m", [1, 5])
def test_skinny_matmul_plain_rows_lower(m):
  cfg = skinny.default_config(m, 1024, 1024)
  for per_slot in (False, True):
    shape = (2, m, 1024) if per_slot else (m, 1024)
    fn = lambda x, w, ids: skinny.skinny_matmul_parts((x,), skinny.Plain(per_slot), w, ids, m, bf16, cfg,
                                                      interpret=False)
    _lowers(fn, (shape, bf16), ((4, 1024, 1024), bf16), ((2,), jnp.int32), triggers=0)


@pytest.mark.parametrize("w_dtype", [jnp.int8, jnp.bfloat16])
def test_skinny_matmul_epilogue_lowers(w_dtype):
  """W_in's kernel writing the hidden layer (medium-moe's batch-32 groups: 16 rows through 32 experts' W_in)."""
  cfg = skinny.default_config(16, 1024, 4096, 32)
  act = skinny.Activated(activation=PLAIN[jax.nn.gelu], dtype=jnp.dtype(bf16), scaled=w_dtype == jnp.int8)
  shape = (64, 4096, 1024) if w_dtype == jnp.int8 else (64, 1024, 4096)
  fn = lambda x, w, ids, s: skinny.skinny_matmul_parts((x,), skinny.Plain(True), w, ids, 16, bf16, cfg, epilogue=act,
                                                       epilogue_operands=(s,) if act.scaled else (), interpret=False)
  _lowers(fn, ((32, 16, 1024), bf16), (shape, w_dtype), ((32,), jnp.int32), ((64, 4096), jnp.float32), triggers=0)

def test_decode_qkv_lowers():
  fn = lambda p, k, v, i, s: qkv.decode_qkv(p, k, v, i, s, inverse_frequencies(64, 1e4), bf16, interpret=False)
  _lowers(fn, ((8, 1, 3 * 16 * 64), jnp.float32), ((1, 160, 16, 64), bf16), ((1, 160, 16, 64), bf16),
          ((), jnp.int32), ((1,), jnp.int32))


@pytest.mark.parametrize("splits,dynamic", [(3, False), (1, False), (1, True)])
def test_decode_attention_lowers(splits, dynamic):
  cfg = attention.Config(chunk=64, splits=splits, dynamic_loop=dynamic)
  fn = lambda q, k, v, s, i: attention.split_attention(q, k, v, s, i, cfg, interpret=False)
  _lowers(fn, ((2, 16, 64), bf16), ((2, 160, 16, 64), bf16), ((2, 160, 16, 64), bf16), ((2,), jnp.int32),
          ((), jnp.int32))


@pytest.mark.parametrize("norm", [False, True])
def test_decode_router_lowers(norm):
  cfg = router.default_config(1024, 64)
  fn = lambda x, w, g: router.decode_router(x, w, 1, False, cfg, interpret=False, norm=(g, 1e-6) if norm else None)
  _lowers(fn, ((1, 1024), bf16), ((1024, 64), jnp.float32), ((1024,), jnp.float32))


def test_router_logit_parts_lower():
  """The router's logits kernel alone, adding a pending product's 8 split-K parts to x first, and its select
  kernel alone."""
  cfg = router.default_config(1024, 64)
  fn = lambda x, w, g: router.logit_parts(x, w, cfg, interpret=False, norm=(g, 1e-6))
  _lowers(fn, ((1, 1024), bf16), ((1024, 64), jnp.float32), ((1024,), jnp.float32))
  fn = lambda x, w, g, p: router.logit_parts(x, w, cfg, interpret=False, norm=(g, 1e-6), pending=p)
  _lowers(fn, ((1, 1024), bf16), ((1024, 64), jnp.float32), ((1024,), jnp.float32), ((8, 1, 1024), jnp.float32))
  _lowers(lambda p: router.select(p, 2, True, interpret=False), ((1, 4, 64), jnp.float32))


@pytest.mark.parametrize("t,k,e,d", [(32, 1, 64, 1024), (20, 3, 6, 64)])
def test_group_rows_lowers(t, k, e, d):
  _lowers(lambda x, ids: group_rows.group_rows(x, ids, e, 16, interpret=False), ((t, d), bf16), ((t * k,), jnp.int32))


@pytest.mark.parametrize("chunk", [16384, 1024])  # a row held whole, and read in chunks each bisection step
def test_block_rounding_kernel_lowers(chunk):
  cfg = block_rounding.Config(chunk=chunk)
  _lowers(lambda p, e, n: block_rounding.block_moves(p, e, n, 128, cfg), ((16384, 64), jnp.float32),
          ((16384, 2), jnp.int32), ((16384,), jnp.int32), triggers=0)


@pytest.mark.parametrize("chunk", [16384, 1024])
def test_group_rounding_kernels_lower(chunk):
  """Under an axis: each device's first members compacted by a masked store, then the group's n-th."""
  cfg = block_rounding.Config(chunk=chunk)
  moves = lambda p, e, n: jax.vmap(lambda *a: block_rounding.group_moves(*a, 128, "g", cfg), axis_name="g")(p, e, n)
  _lowers(moves, ((8, 16384, 64), jnp.float32), ((8, 16384, 1), jnp.int32), ((8, 16384), jnp.int32), triggers=0)


def test_row_gather_lowers():
  _lowers(lambda x, src: row_moves.gather_rows(x, src, interpret=False), ((512, 256), bf16), ((640,), jnp.int32),
          triggers=0)


def _mosaic_lowers(monkeypatch, fn, *args):
  """fn lowers for CUDA with one Mosaic GPU custom call or more, as compiled (not interpreted) on
  an H100's 132 SMs: this runs Mosaic GPU's own lowering (layout inference included), which the
  interpreter skips, e.g. where a tile shape or swizzle has no wgmma layout."""
  from sparsejax.kernels.gmm import mosaic
  monkeypatch.setattr(mosaic, "_interpret", lambda: None)
  monkeypatch.setattr(mosaic, "_num_sms", lambda: 132)
  text = lower_for_gpu(fn, *args).as_text()
  assert text.count("mosaic_gpu") >= 1
  return text


def _topo():
  """Four experts of 256, 0, 128 and 384 padded rows (250, 0, 40 and 300 tokens) in 1,024 rows of
  128-row blocks: an empty expert, partial blocks, 192 rows an expert on average (the short forms)."""
  from sparsejax.topology import make_topology
  return make_topology(jnp.asarray([256, 0, 128, 384], jnp.int32), 1024, 128,
                       jnp.asarray([250, 0, 40, 300], jnp.int32))


@pytest.mark.parametrize("schedule", ["default", "cooperative", "pingpong_all", "epilogue_wg", "split_tail"])
def test_mosaic_gmm_kernels_lower(monkeypatch, schedule):
  """Every gmm kind (plain, transposed, act, dact, glu, dglu) on each schedule: the defaults
  (gmm_act and gmm_dact ping-pong), the cooperative kernel, the ping-pong kernel for all, and
  gmm_act / gmm_dact with the epilogue warpgroup (the other kinds as their defaults). A kind that a
  schedule leaves at its default config is the "default" case's kernel and is lowered there. (A 32-deep
  K step of the ping-pong gmm_act, which failed to compile on an H100, fails here too.)"""
  import dataclasses

  from sparsejax.kernels.gmm import mosaic
  from sparsejax.kernels.gmm import mosaic_epilogue
  pp = mosaic.DEFAULT_CONFIGS.gmm_act
  # The test's experts average 192 rows, so gmm_glu takes gmm_glu_short (ping-pong by default).
  sets = {"default": {}, "cooperative": dict(gmm_act=mosaic.COOPERATIVE_ACT, gmm_dact=mosaic.COOPERATIVE_DACT,
                                             gmm_glu_short=mosaic.DEFAULT_CONFIGS.gmm_glu),
          "pingpong_all": dict(gmm=pp, gmm_t=pp, gmm_act=pp, gmm_dact=pp, gmm_glu=pp, gmm_glu_short=pp, gmm_dglu=pp),
          "epilogue_wg": mosaic_epilogue.CONFIGS,
          # The last wave's pieces (half and quarter width) in pipelines of their own, every cooperative kind.
          "split_tail": {k: dataclasses.replace(c, split_tail=True) for k, c in dict(
              gmm=mosaic.DEFAULT_CONFIGS.gmm, gmm_t=mosaic.DEFAULT_CONFIGS.gmm_t, gmm_act=mosaic.COOPERATIVE_ACT,
              gmm_dact=mosaic.COOPERATIVE_DACT, gmm_glu_short=mosaic.DEFAULT_CONFIGS.gmm_glu,
              gmm_dglu=mosaic.DEFAULT_CONFIGS.gmm_dglu).items()}}
  cfgs = dataclasses.replace(mosaic.DEFAULT_CONFIGS, **sets[schedule])
  topo = _topo()
  x, w, w_t = (jax.ShapeDtypeStruct(s, bf16) for s in [(1024, 512), (4, 512, 384), (4, 384, 512)])
  pre = jax.ShapeDtypeStruct((1024, 384), bf16)

  def lowers(kind, fn, *args):
    # A kind whose config this schedule leaves at its default (e.g. gmm and gmm_t under "epilogue_wg")
    # lowers exactly the kernel of the "default" case, which lowers it: once is enough.
    rows, experts = x.shape[0], topo.num_experts
    default = mosaic.DEFAULT_CONFIGS.gmm_for(kind, rows, experts)
    if schedule != "default" and cfgs.gmm_for(kind, rows, experts) == default:
      return
    _mosaic_lowers(monkeypatch, fn, *args)

  lowers("gmm", lambda a, b: mosaic.gmm(a, b, topo, False, bf16, cfgs), x, w)
  lowers("gmm_t", lambda a, b: mosaic.gmm(a, b, topo, True, jnp.float32, cfgs), pre, w_t)
  lowers("gmm_act", lambda a, b: mosaic.gmm_act(a, b, topo, jax.nn.gelu, cfgs), x, w)
  lowers("gmm_dact", lambda a, b, p: mosaic.gmm_dact(a, b, topo, p, jax.nn.silu, cfgs), pre, w_t, x)
  lowers("gmm_glu", lambda a, b, c: mosaic.gmm_glu(a, b, c, topo, jax.nn.silu, cfgs), x, w, w)
  lowers("gmm_dglu", lambda a, b, p: mosaic.gmm_dglu(a, b, topo, p, p, jax.nn.silu, cfgs), pre, w_t, x)
  # N of 40: 64-wide tiles.
  lowers("gmm_act", lambda a, b: mosaic.gmm_act(a, b, topo, jax.nn.gelu, cfgs), x,
         jax.ShapeDtypeStruct((4, 512, 40), bf16))


@pytest.mark.parametrize("schedule", [dict(pingpong=False), dict(pingpong=True),
                                      dict(streamed=True, max_concurrent_steps=3, epi_slots=4)],
                         ids=["per_tile", "pingpong", "streamed"])
@pytest.mark.parametrize("out_dtype", [bf16, jnp.float32])
def test_mosaic_tgmm_kernels_lower(monkeypatch, schedule, out_dtype):
  """tgmm on each of its schedules (the per-tile pipeline, ping-pong, one streamed ring)."""
  from sparsejax.kernels.gmm import mosaic
  cfgs = mosaic.DEFAULT_CONFIGS.with_tgmm(**schedule)
  topo = _topo()
  x, dy = jax.ShapeDtypeStruct((1024, 512), bf16), jax.ShapeDtypeStruct((1024, 384), bf16)
  _mosaic_lowers(monkeypatch, lambda a, b: mosaic.tgmm(a, b, topo, out_dtype, cfgs), x, dy)


def test_mosaic_kernels_carry_their_kind_and_schedule_in_their_names(monkeypatch):
  """Each Mosaic kernel is named for its variant and schedule (sparsejax_gmm_act_pingpong, ...), so
  a profile tells the expert MLP's six kernels apart (all were body_mosaic_gpu_kernel)."""
  from sparsejax.kernels.gmm import mosaic
  topo = _topo()  # 192 rows an expert: the short forms
  x, w = jax.ShapeDtypeStruct((1024, 512), bf16), jax.ShapeDtypeStruct((4, 512, 384), bf16)
  h = jax.ShapeDtypeStruct((1024, 384), bf16)
  for fn, args, name in [
      (lambda a, b: mosaic.gmm_act(a, b, topo, jax.nn.gelu), (x, w), "gmm_act_pingpong"),
      (lambda a, b: mosaic.gmm(a, b, topo, False, bf16), (x, w), "gmm_cooperative"),
      (lambda a, b: mosaic.tgmm(a, b, topo, bf16), (x, h), "tgmm_pingpong"),
      (lambda a, b: mosaic.tgmm(a, b, topo, bf16, mosaic.DEFAULT_CONFIGS.with_tgmm(pingpong=False)), (x, h),
       "tgmm_per_tile")]:
    assert f"sparsejax_{name}_mosaic_gpu" in _mosaic_lowers(monkeypatch, fn, *args)


def test_triton_kernel_lowers_once_for_all_its_call_sites():
  """A kernel that several layers of one program call alike is lowered once (shared_lowering.py),
  so it is traced, lowered and compiled once. A call with other shapes is a kernel of its own."""

  def layers(x, w, ids):
    cfg = skinny.default_config(1, 1024, 1024)
    for _ in range(3):
      parts = skinny.skinny_matmul_parts((x,), skinny.Plain(False), w, ids, 1, bf16, cfg, interpret=False)
      x = parts.sum(axis=(0, 1))[:1].astype(bf16)
    return row_moves.gather_rows(x, ids, interpret=False)

  args = [jax.ShapeDtypeStruct(s, d) for s, d in (((1, 1024), bf16), ((4, 1024, 1024), bf16), ((2,), jnp.int32))]
  text = lower_for_gpu(layers, *args).as_text()
  assert text.count("xla.gpu.triton") == 2


def test_triton_gmm_lowers_once_for_all_its_call_sites(monkeypatch):
  """The gmm and tgmm of GPUs other than Hopper (and of float32 on Hopper) lower for CUDA, each once
  for its alike calls; a transposed gmm is a kernel of its own."""
  from sparsejax.kernels.gmm import triton as gmm_triton
  monkeypatch.setattr(gmm_triton, "_interpret", lambda: False)
  topo = _topo()

  def layers(x, w, h):
    for _ in range(3):
      x = gmm_triton.gmm(x, w, topo, False, jnp.float32)
    dx = gmm_triton.gmm(x, w, topo, True, jnp.float32)
    return dx, [gmm_triton.tgmm(x, h, topo, jnp.float32) for _ in range(3)]

  f32 = jnp.float32
  args = [jax.ShapeDtypeStruct(s, f32) for s in ((1024, 512), (4, 512, 512), (1024, 384))]
  text = lower_for_gpu(layers, *args).as_text()
  assert text.count("xla.gpu.triton") == 3


def test_mosaic_kernel_lowers_once_for_all_its_call_sites(monkeypatch):
  """As the Triton kernels, Mosaic GPU kernels called alike are lowered once, and so compiled once
  on the GPU (jaxlib 0.11 gives every lowering a module of its own, whose hash the compile cache
  keys on, so each call site paid its own compile)."""
  from sparsejax.kernels.gmm import mosaic
  topo = _topo()

  def layers(x, w, w_other):
    for _ in range(3):
      x = mosaic.gmm(x, w, topo, False, bf16)
    return mosaic.gmm(x, w_other, topo, False, bf16)

  text = _mosaic_lowers(monkeypatch, layers, jax.ShapeDtypeStruct((1024, 512), bf16),
                        jax.ShapeDtypeStruct((4, 512, 512), bf16), jax.ShapeDtypeStruct((4, 512, 256), bf16))
  assert text.count("@mosaic_gpu_v2(") == 2
