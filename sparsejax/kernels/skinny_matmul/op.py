"""skinny_matmul: a product of a few rows (decoding) with a weight, or with chosen experts' weights.

  w [k, n]:               y[r]    = x[r] @ w, r over x's leading axes          (* scale[n])
  w [e, k, n], experts:   y[s, m] = x_s[m] @ w[experts[s]]   (* scale[experts[s], n])
with x_s = x (shared, [m, k]) or x[s] ([slots, m, k]); the result is float32. int8 w is stored k-major,
[n, k] or [e, n, k] (inference.quantize_weight's layout: reference.k_major), and read as its transpose.
A slot whose id is outside [0, E) holds no expert: its rows are zero and it reads no weight. Weights enter the
product as x's dtype, cast where they are loaded: int8 exactly (|q| <= 127), with the per-column
scale on the float32 result, so no dequantized (or float32-to-bf16) copy of a weight is ever
written. Only the chosen experts' weights are read.
norm = (g, eps) puts sparsejax.norm.rms_norm(x, g, eps) in x's place (a shared x only): a decode
step's RMSNorm then runs inside the product's programs (folds_norm) instead of as kernels of its
own, within x's dtype rounding of the reference (which rounds the normalized x; the kernel x * g).
Backends: "triton" (triton.py; off the GPU in interpret mode) and "xla" (reference.py, an einsum);
"auto" takes triton on a GPU when m <= MAX_ROWS and k, n are multiples of 16, where this jax has
Pallas' Triton backend. Differentiable: the cotangents are the reference's.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Num

from sparsejax import _checks
from sparsejax._precision import dot_precision
from sparsejax.activations import PLAIN
from sparsejax.kernels import auto_takes_triton, require_triton
from sparsejax.kernels._reference_vjp import with_reference_vjp
from sparsejax.kernels.decode_router.reference import select_from_parts
from sparsejax.kernels.skinny_matmul import triton, triton_row_ffn
from sparsejax.kernels.skinny_matmul.reference import k_major, kn, skinny_matmul_reference
from sparsejax.norm import rms_norm

IMPLS = ("auto", "triton", "xla")
# Rows the kernel takes: it pads them to a power of two >= 16, one tensor-core tile of rows at most 64.
MAX_ROWS = 64
# Where fuses_hidden does not hold but W_in's programs each take all of K, W_in's kernel writes h itself
# (activates_in_first); False keeps the two-call form there (an A-B switch, read where skinny_ffn is traced).
HIDDEN_EPILOGUE = True


def _check(x, w, experts, scale, norm, impl):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  _checks.check_floating("x", x)
  if w.ndim not in (2, 3):
    raise ValueError(f"w must be [k, n] or [experts, k, n]; got shape {w.shape}.")
  if w.ndim == 2:
    if experts is not None:
      raise ValueError("experts selects from w [experts, k, n]; w is [k, n].")
    if x.ndim < 1:
      raise ValueError("x must be [..., k] for w [k, n]; got a scalar.")
  else:
    if experts is None:
      raise ValueError(f"w is [experts, k, n] = {w.shape}: give experts, the [slots] expert ids to read.")
    _checks.check_rank("experts", experts, 1, "[slots]")
    _checks.check_integer("experts", experts)
    if x.ndim not in (2, 3):
      raise ValueError(f"x must be [m, k] (shared by every slot) or [slots, m, k]; got shape {x.shape}.")
    if x.ndim == 3 and x.shape[0] != experts.shape[0]:
      raise ValueError(f"x is [slots={x.shape[0]}, m, k] but experts has {experts.shape[0]} slots.")
  k, n = kn(w)
  if x.shape[-1] != k:
    stored = f"{n}, {k}] (int8: k-major)" if k_major(w.dtype) else f"{k}, {n}]"
    raise ValueError(f"x has k={x.shape[-1]} but w is {'[e, ' if w.ndim == 3 else '['}{stored}.")
  if jnp.result_type(w) == jnp.int8:
    if scale is None:
      raise ValueError("int8 w needs scale, its per-output-column float scales.")
  else:
    _checks.check_floating("w", w)
  if scale is not None:
    _checks.check_floating("scale", scale)
    want = (n,) if w.ndim == 2 else (w.shape[0], n)
    if scale.shape != want:
      raise ValueError(f"scale must have shape {want} (one per output column{' per expert' if w.ndim == 3 else ''}); "
                       f"got {scale.shape}.")
  if norm is not None:
    if w.ndim == 3 and x.ndim == 3:
      raise ValueError("norm applies to a shared x ([m, k] or [..., k]), not to per-slot rows [slots, m, k].")
    _checks.check_floating("norm scale", norm[0])
    if norm[0].shape != (k,):
      raise ValueError(f"the norm's scale must have shape ({k},) (one per column of x); got {norm[0].shape}.")
  if impl == "triton":
    require_triton("skinny_matmul(impl='triton')")
    m = x.size // x.shape[-1] if w.ndim == 2 else x.shape[-2]
    if m > MAX_ROWS:
      raise ValueError(f"impl='triton' takes at most {MAX_ROWS} rows; got m={m} (use impl='auto').")
    if triton.default_config(m, k, n) is None:
      raise ValueError(f"impl='triton' needs k and n multiples of 16; got k={k}, n={n} (use impl='auto').")


def _interpret() -> bool:
  return jax.default_backend() != "gpu"


def _normed(x, norm_scale, eps):
  return x if norm_scale is None else rms_norm(x, norm_scale, eps)


def _slots(x, ids):
  return x if x.ndim == 3 else jnp.broadcast_to(x, (ids.shape[0],) + x.shape)


def _source(x, norm):
  return triton.Plain(per_slot=x.ndim == 3) if norm is None else triton.Normed(eps=float(norm[1]))


def _kernel_product(x, w3, ids, norm):
  """[slots, m, n] float32 from the kernel (no scale), differentiable through the reference."""
  m, k = x.shape[-2:]
  cfg = triton.default_config(m, k, kn(w3)[1], ids.shape[0])
  source, eps = _source(x, norm), None if norm is None else float(norm[1])

  def kernel(x, w3, ids, ns):
    operands = (x,) if ns is None else (x, ns)
    parts = triton.skinny_matmul_parts(operands, source, w3, ids, m, x.dtype, cfg, interpret=_interpret())
    return parts.sum(axis=1)[:, :m]

  def reference(x, w3, ids, ns):
    return skinny_matmul_reference(_slots(_normed(x, ns, eps), ids), w3, ids)

  return with_reference_vjp(kernel, reference, x, w3, ids, None if norm is None else norm[0])


def runs_kernel(m: int, k: int, n: int, impl: str = "auto") -> bool:
  """Whether skinny_matmul of m rows by a [k, n] weight runs the Pallas kernel (else XLA): impl
  "triton", or "auto" on a GPU for at most MAX_ROWS rows when the kernel has tiles for k and n, where this
  jax has Pallas' Triton backend. The fused forms below (folds_norm, fuses_hidden, ...) all start from it."""
  return impl == "triton" or (impl == "auto" and jax.default_backend() == "gpu" and m <= MAX_ROWS
                              and triton.default_config(m, k, n) is not None and auto_takes_triton())


def folds_norm(m: int, k: int, n: int, impl: str = "auto") -> bool:
  """Whether skinny_matmul(x [m, k], w [.., k, n], norm=...) takes the norm inside its kernel (else
  XLA's kernels normalize x first): where the kernel runs and the rows are small (triton.norm_fits)."""
  return runs_kernel(m, k, n, impl) and triton.norm_fits(m, k)


def _norm_unless_folded(x, norm, m, k, n, impl):
  """(x, norm) for a product that folds the norm into its kernel, else (rms_norm(x), None): XLA's two
  kernels for the norm, then the product."""
  if norm is None or folds_norm(m, k, n, impl):
    return x, norm
  return rms_norm(x, *norm), None


def skinny_matmul(
    x: Float[Array, "*m k"] | Float[Array, "slots m k"],
    w: Num[Array, "k n"] | Num[Array, "experts k n"],
    *,
    experts: Int[Array, "slots"] | None = None,
    scale: Float[Array, "n"] | Float[Array, "experts n"] | None = None,
    norm: tuple[Float[Array, "k"], float] | None = None,
    impl: str = "auto",
) -> Float[Array, "*m n"] | Float[Array, "slots m n"]:
  """y = x @ w, or y[s] = x_s @ w[experts[s]], times the per-column scale; float32 (see the module doc).
  With w [k, n], x's leading dimensions are rows, as in jnp.dot. norm = (g, eps): x is first
  RMS-normalized with scale g (in the kernel's programs where it runs)."""
  _check(x, w, experts, scale, norm, impl)
  dense = w.ndim == 2
  if dense and x.ndim != 2:
    lead = x.shape[:-1]
    y = skinny_matmul(x.reshape(-1, x.shape[-1]), w, scale=scale, norm=norm, impl=impl)
    return y.reshape(*lead, kn(w)[1])
  w3 = w[None] if dense else w
  ids = jnp.zeros((1,), jnp.int32) if dense else experts.astype(jnp.int32)
  m, k = x.shape[-2:]
  n = kn(w)[1]
  x, norm = _norm_unless_folded(x, norm, m, k, n, impl)
  if runs_kernel(m, k, n, impl):
    y = _kernel_product(x, w3, ids, norm)
  elif dense:  # a plain dot: no gather of the one weight
    wk = (w.T if k_major(w.dtype) else w).astype(x.dtype)
    y = jnp.dot(x, wk, precision=dot_precision(x.dtype), preferred_element_type=jnp.float32)[None]
  else:
    y = skinny_matmul_reference(_slots(x, ids), w3, ids)
  if scale is not None:
    s = scale[None] if dense else jnp.take(scale, ids, axis=0, mode="clip")
    y = y * s.astype(jnp.float32)[:, None, :]
  return y[0] if dense else y


def _as3(w, scale):
  """A dense weight [k, n] (and its scale [n]) as the one expert of [1, k, n] ([1, n])."""
  if w is None or w.ndim == 3:
    return w, scale
  return w[None], None if scale is None else scale[None]


def _hidden(up, gate, activation, dtype):
  """h = act(g) * u, or act(u), rounded to dtype, from the float32 products: u and g are rounded to dtype
  first and the activation runs in float32 (as the kernel's Hidden source does), so the two-call and
  fused forms round alike. (In dtype's own arithmetic a bf16 GELU is off by a few ulps of h.) On a GPU, XLA may
  keep u in float32 all the same (xla_allow_excess_precision, on by default): there the two-call form departs
  from the kernels' rounding by up to a bf16 ulp of h (experiments/notes_decode.md, forty-eighth session)."""
  f32 = lambda v: v.astype(dtype).astype(jnp.float32)
  h = activation(f32(up)) if gate is None else activation(f32(gate)) * f32(up)
  return h.astype(dtype)


def fuses_hidden(m: int, d: int, f: int, activation, impl: str = "auto", slots: int = 1) -> bool:
  """Whether skinny_ffn runs the hidden layer inside W_out's kernel (else as an XLA kernel between
  the products): both products run the kernel, the activation is one a kernel body computes
  (sparsejax.activations.PLAIN), and each program's share of the partials is small (hidden_fits)."""
  if not (runs_kernel(m, d, f, impl) and runs_kernel(m, f, d, impl) and activation in PLAIN):
    return False
  cfg_in = triton.default_config(m, d, f, slots)
  if cfg_in is None:  # d or f not a multiple of 16: no tiles (impl="triton" then runs the reference)
    return False
  parts_rows = triton.padded_rows(m, cfg_in.use_dot)
  return triton.hidden_fits(parts_rows, d // cfg_in.rows_per_program, m, f, d, slots)


def activates_in_first(m: int, d: int, f: int, activation, impl: str = "auto", slots: int = 1,
                       gated: bool = False) -> bool:
  """Whether skinny_ffn's W_in kernel computes the hidden layer in its epilogue (triton.Activated) where
  fuses_hidden does not hold: both products on the kernel, a plain activation, no gate, and W_in's programs
  each taking all of K (one split), so each holds its columns' whole sum. Then no XLA kernel runs between the
  products, and W_out reads h in x's dtype instead of a float32 product."""
  if not (HIDDEN_EPILOGUE and not gated and runs_kernel(m, d, f, impl) and runs_kernel(m, f, d, impl)
          and activation in PLAIN):
    return False
  cfg_in = triton.default_config(m, d, f, slots)
  return cfg_in is not None and cfg_in.rows_per_program == d


def runs_row_ffn(m: int, d: int, f: int, activation, impl: str = "auto", w_dtype=jnp.bfloat16,
                 gated: bool = False, slots: int = 1) -> bool:
  """Whether skinny_ffn runs as one kernel whose programs each take a slab of the hidden layer through
  both products (triton_row_ffn; else the split form, fuses_hidden): one row, both products on the
  kernel, an activation a kernel body computes, and a program's slabs small enough (triton_row_ffn.fits)."""
  return (runs_kernel(m, d, f, impl) and runs_kernel(m, f, d, impl) and activation in PLAIN
          and triton_row_ffn.fits(m, d, f, w_dtype, gated, slots))


def _one_width(*weights) -> bool:
  """Whether the weights given (None skipped) share one element width: the row form's slabs are sized by it."""
  return len({jnp.dtype(w.dtype).itemsize for w in weights if w is not None}) == 1


def _check_ffn(x, w_in, w_out, experts, w_gate, w_in_scale, w_gate_scale, w_out_scale, norm, impl):
  _check(x, w_in, experts, w_in_scale, norm, impl)
  if w_gate is not None:
    if w_gate.shape != w_in.shape:
      raise ValueError(f"w_gate must have w_in's shape {w_in.shape}; got {w_gate.shape}.")
    _check(x, w_gate, experts, w_gate_scale, norm, impl)
  elif w_gate_scale is not None:
    raise ValueError("w_gate_scale given without w_gate.")
  want = w_in.shape[:-2] + (w_in.shape[-1], w_in.shape[-2])
  if w_out.shape != want:
    raise ValueError(f"w_out must be {want} (w_in {w_in.shape} transposed in its last two axes); got {w_out.shape}.")
  # The second product's x: h [*m, f] for a dense weight, [slots, m, f] for experts.
  lead = x.shape[:-1] if w_in.ndim == 2 or x.ndim == 3 else (experts.shape[0],) + x.shape[:-1]
  _check(jax.ShapeDtypeStruct(lead + (kn(w_in)[1],), x.dtype), w_out, experts, w_out_scale, None, impl)


def skinny_ffn(
    x: Float[Array, "*m d"] | Float[Array, "slots m d"],
    w_in: Num[Array, "d f"] | Num[Array, "experts d f"],
    w_out: Num[Array, "f d"] | Num[Array, "experts f d"],
    *,
    experts: Int[Array, "slots"] | None = None,
    w_gate: Num[Array, "d f"] | Num[Array, "experts d f"] | None = None,
    activation: Callable = jax.nn.gelu,
    w_in_scale: Float[Array, "f"] | Float[Array, "experts f"] | None = None,
    w_gate_scale: Float[Array, "f"] | Float[Array, "experts f"] | None = None,
    w_out_scale: Float[Array, "d"] | Float[Array, "experts d"] | None = None,
    norm: tuple[Float[Array, "d"], float] | None = None,
    impl: str = "auto",
) -> Float[Array, "*m d"] | Float[Array, "slots m d"]:
  """y = h @ W_out with h = act(x W_in), or act(x W_gate) * (x W_in), per slot's expert; float32.

  Each product is skinny_matmul's (the same experts, scales and norm), and h is rounded to x's dtype
  as the two-call form rounds it. At one row where a program's slabs fit (runs_row_ffn), one kernel
  runs it all: program j takes hidden columns F_j through both products and the caller's sum over j
  is the product. Else where the kernels run (fuses_hidden), W_in's (and W_gate's) split-K partials
  are left unsummed and W_out's programs sum them, scale, round and apply the activation as they
  load their slab of h: no kernel of its own for the hidden layer. Where they do not, but W_in's programs
  each take all of K (activates_in_first), W_in's kernel writes h itself. Differentiable: the cotangents
  are the two-call form's.
  """
  _check_ffn(x, w_in, w_out, experts, w_gate, w_in_scale, w_gate_scale, w_out_scale, norm, impl)
  return _skinny_ffn(x, w_in, w_out, experts, w_gate, activation, w_in_scale, w_gate_scale, w_out_scale, norm, impl)


def _skinny_ffn(x, w_in, w_out, experts, w_gate, activation, w_in_scale, w_gate_scale, w_out_scale, norm, impl,
                epilogue=None):
  """skinny_ffn's body (arguments checked). epilogue = (combine, residual): skinny_ffn_residual's result, for
  a call that fuses_residual holds for; the row kernel's parts then go to triton_row_ffn.residual_epilogue."""
  dense = w_in.ndim == 2
  if dense and x.ndim != 2:
    lead = x.shape[:-1]
    y = skinny_ffn(x.reshape(-1, x.shape[-1]), w_in, w_out, w_gate=w_gate, activation=activation,
                   w_in_scale=w_in_scale, w_gate_scale=w_gate_scale, w_out_scale=w_out_scale, norm=norm,
                   impl=impl)
    return y.reshape(*lead, kn(w_out)[1])
  m, d = x.shape[-2:]
  f = kn(w_in)[1]
  dt = x.dtype
  slots = 1 if dense else experts.shape[0]
  gated = w_gate is not None
  row = _one_width(w_in, w_gate, w_out) and runs_row_ffn(m, d, f, activation, impl, w_in.dtype, gated, slots)
  fused = row or fuses_hidden(m, d, f, activation, impl, slots)
  epilogued = not fused and activates_in_first(m, d, f, activation, impl, slots, gated)
  if not fused and not epilogued:
    first = lambda w, s: skinny_matmul(x, w, experts=experts, scale=s, norm=norm, impl=impl)
    return skinny_matmul(_hidden(first(w_in, w_in_scale), None if w_gate is None else first(w_gate, w_gate_scale),
                                 activation, dt), w_out, experts=experts, scale=w_out_scale, impl=impl)
  if not row:
    x, norm = _norm_unless_folded(x, norm, m, d, f, impl)
  ids = jnp.zeros((1,), jnp.int32) if dense else experts.astype(jnp.int32)
  (w_in3, s_in), (w_gate3, s_gate), (w_out3, s_out) = (
      _as3(w_in, w_in_scale), _as3(w_gate, w_gate_scale), _as3(w_out, w_out_scale))
  source, eps = _source(x, norm), None if norm is None else float(norm[1])
  x_operands = lambda x, ns: (x,) if ns is None else (x, ns)  # what source reads

  if row:  # one kernel: each program takes a slab of h through both products
    def kernel(x, w_in3, w_gate3, w_out3, s_in, s_gate, ns, ids, *epi):
      parts = triton_row_ffn.row_ffn_parts(x_operands(x, ns), source, w_in3, w_gate3, w_out3, s_in, s_gate, ids,
                                           PLAIN[activation], dt, interpret=_interpret())
      if epi:  # (combine, residual, s_out): the sum, the combine and the residual add as one more kernel
        return triton_row_ffn.residual_epilogue(parts, *epi, ids, dt, w_out3.shape[0], interpret=_interpret())
      return parts.sum(axis=1)[:, None, :]
  else:  # two kernels
    cfg_in, cfg_out = triton.default_config(m, d, f, slots), triton.default_config(m, f, d, slots)
    if epilogued:  # W_in's programs write h, W_out's read it
      activated = triton.Activated(activation=PLAIN[activation], dtype=jnp.dtype(dt), scaled=s_in is not None)

      def kernel(x, w_in3, w_gate3, w_out3, s_in, s_gate, ns, ids):
        h = triton.skinny_matmul_parts(x_operands(x, ns), source, w_in3, ids, m, dt, cfg_in, epilogue=activated,
                                       epilogue_operands=() if s_in is None else (s_in,),
                                       interpret=_interpret())[:, 0]  # [slots, padded rows, f]
        parts = triton.skinny_matmul_parts((h,), triton.Plain(per_slot=True), w_out3, ids, h.shape[1], dt, cfg_out,
                                           interpret=_interpret())
        return parts.sum(axis=1)[:, :m]
    else:  # W_out's programs sum W_in's split-K parts as they load h
      hidden = triton.Hidden(activation=PLAIN[activation], dtype=jnp.dtype(dt), splits=d // cfg_in.rows_per_program,
                             up_scaled=s_in is not None, gated=gated, gate_scaled=s_gate is not None)

      def kernel(x, w_in3, w_gate3, w_out3, s_in, s_gate, ns, ids):
        first = lambda w: triton.skinny_matmul_parts(x_operands(x, ns), source, w, ids, m, dt, cfg_in,
                                                     interpret=_interpret())
        operands = (first(w_in3),) + (() if s_in is None else (s_in,))
        if w_gate3 is not None:
          operands += (first(w_gate3),) + (() if s_gate is None else (s_gate,))
        parts = triton.skinny_matmul_parts(operands, hidden, w_out3, ids, m, dt, cfg_out, interpret=_interpret())
        return parts.sum(axis=1)[:, :m]

  def reference(x, w_in3, w_gate3, w_out3, s_in, s_gate, ns, ids, *epi):
    y = _ffn_reference(x, w_in3, w_gate3, w_out3, s_in, s_gate, ns, ids, eps, activation, dt)
    return _residual_epilogue_reference(y, *epi, ids, dt, w_out3.shape[0]) if epi else y

  epi = () if epilogue is None else (*epilogue, s_out)
  y = with_reference_vjp(kernel, reference, x, w_in3, w_gate3, w_out3, s_in, s_gate,
                         None if norm is None else norm[0], ids, *epi)
  if epilogue is not None:
    return y
  if s_out is not None:
    y = y * jnp.take(s_out, ids, axis=0, mode="clip").astype(jnp.float32)[:, None, :]
  return y[0] if dense else y


def _ffn_reference(x, w_in3, w_gate3, w_out3, s_in, s_gate, ns, ids, eps, activation, dt):
  """[slots, m, d] float32: the two-call form of skinny_ffn (unscaled by W_out's scale), x normed when ns is given."""
  xs = _slots(_normed(x, ns, eps), ids)
  gate = None if w_gate3 is None else skinny_matmul_reference(xs, w_gate3, ids, s_gate)
  return skinny_matmul_reference(_hidden(skinny_matmul_reference(xs, w_in3, ids, s_in), gate, activation, dt),
                                 w_out3, ids)


def _residual_epilogue_reference(y, combine, residual, s_out, ids, dtype, num_experts):
  """residual + round(sum_s [0 <= ids[s] < num_experts] combine[:, s] round(y[s] (* s_out[ids[s]]))), in
  residual's dtype; y [slots, m, d] float32, round to dtype; ids None: every slot counts. The decode step's MoE
  combine (decode_moe_mlp's) and the block's residual add."""
  if s_out is not None:
    y = y * jnp.take(s_out, ids, axis=0, mode="clip").astype(jnp.float32)[:, None, :]
  out = y.astype(dtype).astype(jnp.float32)
  combine = combine.astype(jnp.float32)
  if ids is not None:
    combine = jnp.where((ids >= 0) & (ids < num_experts), combine, 0.0)
  z = jnp.einsum("ms,smd->md", combine, out, precision=jax.lax.Precision.HIGHEST)
  return (residual.astype(jnp.float32) + z.astype(dtype).astype(jnp.float32)).astype(residual.dtype)


def fuses_residual(m: int, d: int, f: int, activation, impl: str = "auto", w_dtype=jnp.bfloat16,
                   gated: bool = False, slots: int = 1) -> bool:
  """Whether skinny_ffn_residual runs its epilogue as a kernel after the row form's (runs_row_ffn, and
  triton_row_ffn.epilogue_fits for its parts); else XLA runs it after skinny_ffn."""
  return (runs_row_ffn(m, d, f, activation, impl, w_dtype, gated, slots)
          and triton_row_ffn.epilogue_fits(d, f // triton_row_ffn.slab_columns(w_dtype, f, slots)))


def skinny_ffn_residual(
    x: Float[Array, "m d"],
    w_in: Num[Array, "d f"] | Num[Array, "experts d f"],
    w_out: Num[Array, "f d"] | Num[Array, "experts f d"],
    residual: Float[Array, "m d"],
    *,
    combine: Float[Array, "m slots"] | None = None,
    experts: Int[Array, "slots"] | None = None,
    w_gate: Num[Array, "d f"] | Num[Array, "experts d f"] | None = None,
    activation: Callable = jax.nn.gelu,
    w_in_scale: Float[Array, "f"] | Float[Array, "experts f"] | None = None,
    w_gate_scale: Float[Array, "f"] | Float[Array, "experts f"] | None = None,
    w_out_scale: Float[Array, "d"] | Float[Array, "experts d"] | None = None,
    norm: tuple[Float[Array, "d"], float] | None = None,
    impl: str = "auto",
) -> Float[Array, "m d"]:
  """residual + round(sum_s combine[:, s] round(FFN_s(x))), in residual's dtype, with FFN_s = skinny_ffn's and
  round to x's dtype: a decode step's feed-forward, its MoE combine over the slots (dense weights: combine None,
  one slot of weight 1) and the block's residual add. A slot whose expert is not in [0, experts) (none: FFN_s
  is zero) adds nothing whatever its combine weight, so a router's weights can be passed as they come.

  Where fuses_residual holds (one row, the one-kernel row form), the row kernel's parts are summed, combined
  and added to the residual by one more kernel (triton_row_ffn.residual_epilogue) instead of XLA's reduction
  kernel and add; else XLA runs the same arithmetic after skinny_ffn. Differentiable (the reference's cotangents).
  """
  _check_ffn(x, w_in, w_out, experts, w_gate, w_in_scale, w_gate_scale, w_out_scale, norm, impl)
  dense = w_in.ndim == 2
  if x.ndim != 2:
    raise ValueError(f"skinny_ffn_residual takes x [m, d] (shared by the slots); got shape {x.shape}.")
  m, d = x.shape
  _checks.check_floating("residual", residual)
  if residual.shape != (m, d):
    raise ValueError(f"residual must be x's shape [m={m}, d={d}]; got {residual.shape}.")
  slots = 1 if dense else experts.shape[0]
  if combine is None:
    if not dense:
      raise ValueError("combine ([m, slots], each row's weight of each slot) is needed with expert weights.")
    combine = jnp.ones((m, 1), jnp.float32)
  _checks.check_floating("combine", combine)
  if combine.shape != (m, slots):
    raise ValueError(f"combine must be [m={m}, slots={slots}]; got {combine.shape}.")
  f = kn(w_in)[1]
  if _one_width(w_in, w_gate, w_out) and fuses_residual(m, d, f, activation, impl, w_in.dtype, w_gate is not None, slots):
    return _skinny_ffn(x, w_in, w_out, experts, w_gate, activation, w_in_scale, w_gate_scale, w_out_scale, norm,
                       impl, epilogue=(combine, residual))
  y = _skinny_ffn(x, w_in, w_out, experts, w_gate, activation, w_in_scale, w_gate_scale, w_out_scale, norm, impl)
  return _residual_epilogue_reference(y[None] if dense else y, combine, residual, None, None if dense else experts,
                                      x.dtype, w_in.shape[0])


def fuses_routing(d: int, f: int, activation, impl: str, k: int, splits: int, w_in, w_gate, w_out) -> bool:
  """Whether routed_ffn_residual's kernels select for themselves: the row form with its epilogue for k slots
  (fuses_residual), the weights of one width, and splits and E powers of two (Triton's blocks)."""
  e = w_in.shape[0]
  return (_one_width(w_in, w_gate, w_out) and splits & (splits - 1) == 0 and e & (e - 1) == 0
          and fuses_residual(1, d, f, activation, impl, w_in.dtype, w_gate is not None, k))


def routed_ffn_residual(
    x: Float[Array, "1 d"],
    router_parts: Float[Array, "1 splits experts"],
    w_in: Num[Array, "experts d f"],
    w_out: Num[Array, "experts f d"],
    residual: Float[Array, "1 d"],
    *,
    k: int,
    renormalize: bool,
    w_gate: Num[Array, "experts d f"] | None = None,
    activation: Callable = jax.nn.gelu,
    w_in_scale: Float[Array, "experts f"] | None = None,
    w_gate_scale: Float[Array, "experts f"] | None = None,
    w_out_scale: Float[Array, "experts d"] | None = None,
    norm: tuple[Float[Array, "d"], float] | None = None,
    impl: str = "auto",
) -> tuple[Float[Array, "1 d"], Int[Array, "k"]]:
  """(skinny_ffn_residual(x, ..., experts=ids, combine=weights), ids) for one token routed by its router's
  partial logits: (ids, weights) = decode_router.reference.select_from_parts(router_parts, k, renormalize), the
  parts as decode_router.router_logit_parts makes them.

  Where fuses_residual holds for k slots, the row kernel's programs each select their slot's expert from the
  parts as decode_router's select kernel would (the same exact rule, so they agree), and programs (s, 0) store
  the slots' weights for the epilogue: no kernel runs between the router's logits and the experts'. Else XLA selects and
  skinny_ffn_residual runs. Differentiable (the reference's cotangents, through the weights to the parts)."""
  _checks.check_floating("router_parts", router_parts)
  num_experts = w_in.shape[0] if w_in.ndim == 3 else None
  if w_in.ndim != 3 or router_parts.ndim != 3 or router_parts.shape[0] != 1 or router_parts.shape[2] != num_experts:
    raise ValueError(f"routed_ffn_residual takes expert weights [E, d, f] and router_parts [1, splits, E]; got "
                     f"w_in {w_in.shape}, router_parts {router_parts.shape}.")
  _checks.check_top_k(k, num_experts)
  _check_ffn(x, w_in, w_out, jnp.zeros((k,), jnp.int32), w_gate, w_in_scale, w_gate_scale, w_out_scale, norm, impl)
  if x.ndim != 2 or x.shape[0] != 1:
    raise ValueError(f"routed_ffn_residual takes one token, x [1, d]; got shape {x.shape}.")
  _checks.check_floating("residual", residual)
  if residual.shape != x.shape:
    raise ValueError(f"residual must be x's shape {x.shape}; got {residual.shape}.")
  d, f = kn(w_in)
  dt, renormalize = x.dtype, bool(renormalize)
  if not fuses_routing(d, f, activation, impl, k, router_parts.shape[1], w_in, w_gate, w_out):
    ids, wts = select_from_parts(router_parts, k, renormalize)
    y = skinny_ffn_residual(x, w_in, w_out, residual, combine=wts, experts=ids[0], w_gate=w_gate,
                            activation=activation, w_in_scale=w_in_scale, w_gate_scale=w_gate_scale,
                            w_out_scale=w_out_scale, norm=norm, impl=impl)
    return y, ids[0]
  source, eps = _source(x, norm), None if norm is None else float(norm[1])

  def kernel(x, w_in, w_gate, w_out, s_in, s_gate, s_out, ns, rp, residual):
    parts, ids, wts = triton_row_ffn.row_ffn_parts((x,) if ns is None else (x, ns), source, w_in, w_gate, w_out,
                                                   s_in, s_gate, rp, PLAIN[activation], dt,
                                                   triton_row_ffn.Routed(k, renormalize), interpret=_interpret())
    return triton_row_ffn.residual_epilogue(parts, wts[None], residual, s_out, ids, dt, num_experts,
                                            interpret=_interpret()), ids

  def reference(x, w_in, w_gate, w_out, s_in, s_gate, s_out, ns, rp, residual):
    ids, wts = select_from_parts(rp, k, renormalize)
    y = _ffn_reference(x, w_in, w_gate, w_out, s_in, s_gate, ns, ids[0], eps, activation, dt)
    return _residual_epilogue_reference(y, wts, residual, s_out, ids[0], dt, num_experts), ids[0]

  return with_reference_vjp(kernel, reference, x, w_in, w_gate, w_out, w_in_scale, w_gate_scale, w_out_scale,
                            None if norm is None else norm[0], router_parts, residual)


def split_k_parts(
    x: Float[Array, "m k"],
    w: Num[Array, "k n"],
    *,
    norm: tuple[Float[Array, "k"], float] | None = None,
    impl: str = "auto",
) -> Float[Array, "splits rows n"]:
  """skinny_matmul(x, w, norm=norm) left unsummed: sum_p parts[p, :m] is the product (rows past m are
  padding), for a kernel that sums the parts as it loads them (decode_qkv). Where the product does not
  run the kernel, the product itself is the one part. Differentiable (the reference's cotangents)."""
  if x.ndim != 2 or w.ndim != 2:
    raise ValueError(f"split_k_parts takes x [m, k] and a dense w [k, n]; got x {x.shape}, w {w.shape}.")
  _check(x, w, None, None, norm, impl)
  m, k = x.shape
  n = w.shape[-1]
  x, norm = _norm_unless_folded(x, norm, m, k, n, impl)
  if not runs_kernel(m, k, n, impl):
    return skinny_matmul(x, w, norm=norm, impl="xla")[None]
  cfg = triton.default_config(m, k, n)
  source, eps = _source(x, norm), None if norm is None else float(norm[1])
  splits, rows = k // cfg.rows_per_program, triton.padded_rows(m, cfg.use_dot)

  def kernel(x, w, ns):
    operands = (x,) if ns is None else (x, ns)
    return triton.skinny_matmul_parts(operands, source, w[None], jnp.zeros((1,), jnp.int32), m, x.dtype, cfg,
                                      interpret=_interpret())[0]

  def reference(x, w, ns):
    xs = _normed(x, ns, eps).reshape(m, splits, cfg.rows_per_program)
    parts = jnp.einsum("msk,skn->smn", xs, w.astype(x.dtype).reshape(splits, cfg.rows_per_program, n),
                       precision=dot_precision(x.dtype), preferred_element_type=jnp.float32)
    return jnp.pad(parts, [(0, 0), (0, rows - m), (0, 0)])

  return with_reference_vjp(kernel, reference, x, w, None if norm is None else norm[0])
