"""The MoE layer at small batch (decoding): read only the experts that tokens chose.

At decode time T (tokens in the step) times k is tiny next to E * 128, the rows the block-sparse
layer pads to. The layer is then bound by the bytes of expert weights it reads, so this path
takes the (at most min(T k, E)) distinct chosen experts and runs every token of the step through
each of them in one small batched product (skinny_matmul, which reads each chosen expert in place);
the combine matrix keeps only the chosen (token, expert) pairs. Above ROW_GROUP tokens each expert
takes only its own tokens instead, ROW_GROUP rows a group. What it reads grows with T k, never with E.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Num

from sparsejax import _checks
from sparsejax._precision import dot_precision
from sparsejax.kernels.decode_router import router_logit_parts, splits_logits
from sparsejax.kernels.decode_router.triton import default_config as router_config
from sparsejax.kernels.group_rows import group_rows
from sparsejax.kernels.skinny_matmul import fuses_routing, routed_ffn_residual, skinny_ffn, skinny_ffn_residual
from sparsejax.kernels.skinny_matmul.reference import k_major, kn
from sparsejax.moe import MoEStats, moe_mlp
from sparsejax.norm import rms_norm

# MoE.__call__(decode=True) takes this path when T * k is at most this (a static shape decision).
# Even with every token through every gathered expert (T * n expert FFNs for n = min(T k, E) experts read, T FLOPs
# per weight byte-pair), up to T = 64 that is below an H100's ~300 FLOPs per byte of bandwidth, so the step stays
# bound by the bytes of the experts it reads (int8's conversion aside: COMPACT_ROWS).
SMALL_BATCH_MAX_ASSIGNMENTS = 64
# A decode step at one token lets the experts' row kernel and its epilogue select the token's experts from the
# router's partial logits (selects_in_experts), so the router's select kernel does not run. Read where the layer
# is traced: an A-B (experiments/ab_decode.py --patch) sets it False to run the router's two kernels instead.
SELECTS_IN_EXPERTS = True
# Above ROW_GROUP tokens, each chosen expert takes only the tokens that chose it, in groups of ROW_GROUP rows (the
# kernels' smallest tensor-core tile): every token through every expert pads the products to 32 or 64 rows, and an
# int8 product's time grows with its rows (H200, 8 experts of [4096, 14336]: 129 us at 16 rows, 152 at 32, 217 at
# 64; bf16 222, 235-240; experiments/notes_decode.md, forty-seventh session). Read at trace time; an A-B sets it False.
COMPACT_ROWS = True
ROW_GROUP = 16
# The placement of those groups (kernels.group_rows): "auto" runs its one kernel on a GPU, where XLA ran five or six.
# Read at trace time; an A-B sets it "xla".
GROUP_ROWS_IMPL = "auto"
# The layer's tokens_per_expert above ROW_GROUP tokens: the placement's counts (True) or XLA's own count of the ids.
# Read at trace time; an A-B sets it False.
PLACEMENT_COUNTS = True
# At one token the block hands the MoE layer its attention's W_o product as split-K parts and the router's logits
# kernel adds them to the residual stream (MoE.takes_pending), so no XLA kernel runs for that add. Read at trace
# time; an A-B sets it False.
PENDING_RESIDUAL = True


def _check(x, expert_ids, combine_weights, w_in, w_out, w_gate, scales):
  _checks.check_rank("x", x, 2, "[tokens, d_model]")
  _checks.check_tokens("x", x)
  _checks.check_floating("x", x)
  _checks.check_rank("expert_ids", expert_ids, 2, "[tokens, k]")
  _checks.check_integer("expert_ids", expert_ids)
  _checks.check_rank("combine_weights", combine_weights, 2, "[tokens, k]")
  _checks.check_floating("combine_weights", combine_weights)
  if expert_ids.shape != combine_weights.shape or expert_ids.shape[0] != x.shape[0]:
    raise ValueError(f"expert_ids {expert_ids.shape} and combine_weights {combine_weights.shape} must both "
                     f"be [tokens={x.shape[0]}, k].")
  _checks.check_rank("w_in", w_in, 3, "[experts, d_model, d_ff]")
  _checks.check_rank("w_out", w_out, 3, "[experts, d_ff, d_model]")
  num_experts, (d_model, d_ff) = w_in.shape[0], kn(w_in)
  int8 = " (int8: k-major, as quantize_weight stores it)" if k_major(w_in.dtype) else ""
  if x.shape[1] != d_model:
    raise ValueError(f"x has d_model={x.shape[1]} but w_in is {w_in.shape}{int8}.")
  if w_out.shape[0] != num_experts or kn(w_out) != (d_ff, d_model):
    raise ValueError(f"w_out must be [E, d_ff, d_model] = {(num_experts, d_ff, d_model)} (int8: k-major, "
                     f"{(num_experts, d_model, d_ff)}); got {w_out.shape} {jnp.result_type(w_out)}.")
  if w_gate is not None and w_gate.shape != w_in.shape:
    raise ValueError(f"w_gate must have w_in's shape {w_in.shape}; got {w_gate.shape}.")
  _checks.check_top_k(expert_ids.shape[1], num_experts)
  weights = {"w_in": w_in, "w_out": w_out, "w_gate": w_gate}
  if scales is None:  # float weights of any dtype: each is cast to x's dtype where the kernel loads it
    for name, w in weights.items():
      if w is not None:
        _checks.check_floating(name, w)
    return
  out_dims = {"w_in": d_ff, "w_out": d_model, "w_gate": d_ff}
  for name, w in weights.items():
    s = scales.get(name)
    if w is None:
      if s is not None:
        raise ValueError(f"{name}_scale given without {name}.")
      continue
    if jnp.result_type(w) != jnp.int8:
      raise TypeError(f"{name} must be int8 when scales are given (quantize_experts makes it); "
                      f"got dtype {jnp.result_type(w)}.")
    if s is None:
      raise ValueError(f"{name} is int8 but {name}_scale is missing.")
    _checks.check_floating(f"{name}_scale", s)
    if s.shape != (num_experts, out_dims[name]):
      raise ValueError(f"{name}_scale must be [experts, out channels] = {(num_experts, out_dims[name])}; "
                       f"got {s.shape}.")


def _stats(ids: Int[Array, "n"], num_experts: int, counts: Int[Array, "experts"] | None = None) -> MoEStats:
  """Dropless stats of the flat expert ids (NO_EXPERT, -1, counts nowhere); counts, where given, are theirs."""
  if counts is None:
    counts = jnp.sum(jax.nn.one_hot(jnp.where(ids >= 0, ids, -1), num_experts, dtype=jnp.int32), axis=0)
  zero = jnp.zeros((), jnp.int32)
  return MoEStats(tokens_per_expert=counts, num_dropped=zero, dropped_fraction=zero.astype(jnp.float32))


def decode_moe_mlp(
    x: Float[Array, "tokens d_model"],
    expert_ids: Int[Array, "tokens k"],
    combine_weights: Float[Array, "tokens k"],
    w_in: Num[Array, "experts d_model d_ff"],
    w_out: Num[Array, "experts d_ff d_model"],
    *,
    w_gate: Num[Array, "experts d_model d_ff"] | None = None,
    activation: Callable = jax.nn.gelu,
    w_in_scale: Float[Array, "experts d_ff"] | None = None,
    w_out_scale: Float[Array, "experts d_model"] | None = None,
    w_gate_scale: Float[Array, "experts d_ff"] | None = None,
    norm: tuple[Float[Array, "d_model"], float] | None = None,
    residual: Float[Array, "tokens d_model"] | None = None,
) -> tuple[Float[Array, "tokens d_model"], MoEStats]:
  """y[t] = sum_j c[t, j] FFN_{e[t, j]}(x[t]), reading only the distinct chosen experts.
  norm = (g, eps): of x's rms_norm(x, g, eps) (sparsejax.norm), taken inside the first products.
  residual: the result is residual + y (y rounded to x's dtype, the sum to residual's), the block's add; at one
  token skinny_ffn_residual may do the combine and the add in one kernel after the experts' (fuses_residual).

  With n = min(T k, E) (static): u = the distinct ids of e, padded to n with E (no expert: Y[s] = 0); W_s = W[u_s];
  Y[s, t] = FFN_{W_s}(x[t]) for every slot s and token t; y[t] = sum_s C[t, s] Y[s, t] with
  C[t, s] = sum_j c[t, j] [e[t, j] = u_s] (first matching slot only, so padding never counts twice).
  Above ROW_GROUP tokens each expert takes only its own tokens, ROW_GROUP rows a group (_grouped_rows_ffn).
  int8 weights (with *_scale given), stored k-major as quantize_weight stores them ([E, out, in]):
  W[e][:, o] = q[e][o, :] * scale[e, o], and since the scale is per output column, x W = (x q^T) * scale:
  the int8 values enter the product as x's dtype (exact: |q| <= 127)
  and the scale multiplies the float32 result, so no dequantized weight is ever formed.
  Equals moe_mlp (dropless) on the same inputs; ids of -1 (NO_EXPERT) add nothing.
  """
  scales = None
  if any(s is not None for s in (w_in_scale, w_out_scale, w_gate_scale)) or jnp.result_type(w_in) == jnp.int8:
    scales = {"w_in": w_in_scale, "w_out": w_out_scale, "w_gate": w_gate_scale}
  _check(x, expert_ids, combine_weights, w_in, w_out, w_gate, scales)
  _checks.check_activation(activation)
  scales = scales or {}
  if residual is not None:
    _checks.check_floating("residual", residual)
    if residual.shape != x.shape:
      raise ValueError(f"residual must be x's shape {x.shape}; got {residual.shape}.")
  num_tokens, k = expert_ids.shape
  num_experts = w_in.shape[0]
  n = min(num_tokens * k, num_experts)
  dt = x.dtype
  # The combine's products are float32 whatever dt; a float32 layer asks for HIGHEST in them (a GPU's
  # default float32 dot is TF32), a bf16 one keeps the default its programs always had.
  hi = dot_precision(dt)

  ids = expert_ids.reshape(-1).astype(jnp.int32)
  valid = ids >= 0
  # NO_EXPERT sorts last (as E), so when it does not fit in the n slots it is the one left out.
  key = jnp.where(valid, ids, num_experts)
  ffn = dict(w_gate=w_gate, activation=activation, w_in_scale=scales.get("w_in"), w_gate_scale=scales.get("w_gate"),
             w_out_scale=scales.get("w_out"))
  if COMPACT_ROWS and num_tokens > ROW_GROUP:
    if norm is not None:  # a norm folds into a kernel over a shared x only; at these rows it would not fold anyway
      x = rms_norm(x, *norm)
    y, counts = _grouped_rows_ffn(x, ids, combine_weights.reshape(-1), w_in, w_out, ffn, hi)
    # the placement's own counts: on a GPU its kernel writes them, no XLA kernel counts again
    stats = _stats(ids, num_experts, counts if PLACEMENT_COUNTS else None)
    return (y if residual is None else residual + y.astype(residual.dtype)), stats
  stats = _stats(ids, num_experts)
  if num_tokens == 1:  # one token's k ids are distinct already: no dedup, no sort (batch-1 decoding)
    uniq, slot, picked = ids, jnp.arange(k), valid  # -1 (NO_EXPERT) is a slot with no expert: zero, unread
  else:
    # Sorted, padded with E: a slot with no expert, which skinny_ffn neither reads nor computes. (Padding
    # with a duplicate id ran each padding slot's FFN over again: about 10 of medium-moe's 32 at batch 32.)
    uniq = jnp.unique(key, size=n, fill_value=num_experts)
    hit = key[:, None] == uniq[None, :]  # [T k, n]
    slot = jnp.argmax(hit, axis=1)  # the first matching slot
    picked = valid & jnp.any(hit, axis=1)
  # uniq may hold NO_EXPERT (-1, one token) or E (padding, or NO_EXPERT's sort key): skinny_ffn gives such a
  # slot zero rows without reading a weight, and its combine weight is zero.
  # skinny_ffn reads each chosen expert's weights once (on a GPU, split-K Pallas kernels; XLA's own
  # one-row dot writes the broadcast product out before reducing it) and never gathers a copy of them.
  ffn = dict(ffn, experts=uniq, norm=norm)
  if residual is not None and num_tokens == 1:  # the decode step at batch 1: one kernel may sum, combine, add
    # Slot j is the token's j-th choice, so combine is the router's weights with NO_EXPERT's zeroed, which
    # skinny_ffn_residual does itself: passed as they come, no XLA kernel runs between the router's and the FFN's.
    return skinny_ffn_residual(x, w_in, w_out, residual, combine=combine_weights.reshape(1, k), **ffn), stats
  c = jnp.where(picked, combine_weights.reshape(-1).astype(jnp.float32), 0.0)
  combine = jnp.einsum("tj,tjn->tn", c.reshape(num_tokens, k),
                       jax.nn.one_hot(slot, n, dtype=jnp.float32).reshape(num_tokens, k, n), precision=hi)
  out = skinny_ffn(x, w_in, w_out, **ffn).astype(dt)  # rounded like moe_mlp's expert rows
  y = jnp.einsum("tn,ntd->td", combine, out.astype(jnp.float32), precision=hi).astype(dt)
  return (y if residual is None else residual + y.astype(residual.dtype)), stats


def _grouped_rows_ffn(x: Float[Array, "tokens d_model"], ids: Int[Array, "tk"], c: Float[Array, "tk"],
                      w_in: Num[Array, "experts ..."], w_out: Num[Array, "experts ..."], ffn: dict,
                      precision) -> tuple[Float[Array, "tokens d_model"], Int[Array, "experts"]]:
  """(y, counts): y[t] = sum_j c[t, j] FFN_{e[t, j]}(x[t]) with each expert's tokens in groups of ROW_GROUP rows,
  and counts[e] the pairs on expert e (group_rows').

  kernels.group_rows places pair a = (t, j) (ids[a] = e[t, j]; outside [0, E): no expert) in row r_a % G of group
  g_a = start[e] + r_a // G, r_a its rank among e's pairs and start[e] = sum_{e' < e} ceil(c_e' / G). Group g reads
  expert u_g's weights (u_g = E, no expert, for a group no pair fills: it reads and computes nothing); an expert
  with more than G tokens is read once a group. Pair a's row comes back from slot[a] = g_a G + r_a % G."""
  num_tokens, d = x.shape
  num_experts = w_in.shape[0]
  xs, experts, slot, counts = group_rows(x, ids, num_experts, group=ROW_GROUP, impl=GROUP_ROWS_IMPL)
  out = skinny_ffn(xs, w_in, w_out, experts=experts, **ffn).astype(x.dtype)  # rounded like moe_mlp's expert rows
  picked = jnp.take(out.reshape(-1, d), slot, axis=0, mode="fill", fill_value=0).astype(jnp.float32)  # [tk, d]
  valid = (ids >= 0) & (ids < num_experts)
  c = jnp.where(valid, c.astype(jnp.float32), 0.0)  # a pair with no expert fills no row and adds nothing
  y = jnp.einsum("tj,tjd->td", c.reshape(num_tokens, -1), picked.reshape(num_tokens, -1, d), precision=precision)
  return y.astype(x.dtype), counts


def selects_in_experts(moe, x: Float[Array, "tokens d_model"], activation: Callable) -> bool:
  """Whether the MoE module's decode step at these tokens takes routed_decode_layer: one token, the router's
  two-kernel form (decode_router.splits_logits) and the experts' row kernel with its epilogue for the top-k
  slots on the weights as stored (skinny_matmul.fuses_routing)."""
  c = moe.config
  if not SELECTS_IN_EXPERTS or x.shape[0] != 1 or getattr(moe, "mesh", None) is not None:
    return False
  if not splits_logits(1, c.d_model, c.num_experts, c.top_k):
    return False
  w = expert_weights(moe, x.dtype, quantized=True)
  splits = router_config(c.d_model, c.num_experts).splits
  return fuses_routing(c.d_model, c.d_ff, activation, "auto", c.top_k, splits, w["w_in"], w["w_gate"], w["w_out"])


def routed_decode_layer(
    moe,
    x: Float[Array, "1 d_model"],
    *,
    activation: Callable,
    norm: tuple[Float[Array, "d_model"], float] | None,
    residual: Float[Array, "1 d_model"],
    router_parts: Float[Array, "1 splits experts"] | None = None,
) -> tuple[Float[Array, "1 d_model"], MoEStats, Int[Array, "1 k"]]:
  """(residual + y, stats, ids): the MoE layer at one token as decode_router then decode_moe_mlp compute it, in
  three kernels: the router's partial logits (decode_router.router_logit_parts), then the experts' row kernel
  and its epilogue, which select the token's experts and weights from them (skinny_matmul.routed_ffn_residual).
  norm = (g, eps): the layer's input is rms_norm(x, g, eps), taken inside the router's and the experts' kernels.
  router_parts: the router's partial logits of x where the caller ran its kernel (MoE's pending residual)."""
  c = moe.config
  k = c.top_k
  renormalize = k > 1 if c.renormalize is None else bool(c.renormalize)
  parts = router_logit_parts(x, moe.router.w[...], norm=norm) if router_parts is None else router_parts
  w = expert_weights(moe, x.dtype, quantized=True)
  y, ids = routed_ffn_residual(x, parts, w.pop("w_in"), w.pop("w_out"), residual, k=k, renormalize=renormalize,
                               activation=activation, norm=norm, **w)
  return y, _stats(ids, c.num_experts), ids[None]


def dequantize(q: Num[Array, "experts n_out n_in"], scale: Float[Array, "experts n_out"], dtype
               ) -> Float[Array, "experts n_in n_out"]:
  """W[e, i, o] = q[e, o, i] * scale[e, o], in dtype (q k-major, as quantize_weight stores it)."""
  return (jnp.swapaxes(q, 1, 2).astype(jnp.float32) * scale.astype(jnp.float32)[:, None, :]).astype(dtype)


def expert_weights(moe, dtype, *, quantized: bool) -> dict:
  """The MoE module's expert weights as decode_moe_mlp takes them: as stored, int8 with its scales
  (quantized), or in dtype (dequantized on the fly when the module holds int8)."""
  out = {}
  for name in ("w_in", "w_gate", "w_out"):
    p = getattr(moe, name)
    if p is None:
      out[name] = None
      continue
    w = p[...]
    s = getattr(moe, f"{name}_scale", None)
    if quantized:  # as stored: skinny_matmul casts where it loads, so no converted copy of E experts is made
      out[name] = w
      if s is not None:
        out[f"{name}_scale"] = s[...]
    else:
      out[name] = w.astype(dtype) if s is None else dequantize(w, s[...], dtype)
  return out


def moe_decode_layer(
    moe,
    x: Float[Array, "tokens d_model"],
    expert_ids: Int[Array, "tokens k"],
    combine_weights: Float[Array, "tokens k"],
    w_in: Float[Array, "experts d_model d_ff"],
    w_out: Float[Array, "experts d_ff d_model"],
    *,
    w_gate: Float[Array, "experts d_model d_ff"] | None = None,
    activation: Callable = jax.nn.gelu,
    capacity_factor: float | None = None,
    impl: str = "auto",
    norm: tuple[Float[Array, "d_model"], float] | None = None,
    residual: Float[Array, "tokens d_model"] | None = None,
) -> tuple[Float[Array, "tokens d_model"], MoEStats]:
  """The layer MoE.__call__(decode=True) runs, with moe_mlp's contract; always dropless (capacity_factor
  is ignored: generation must not depend on which other prompts share the batch). norm = (g, eps):
  the layer's input is rms_norm(x, g, eps), folded into the first products on the small-batch path.
  residual: the result is residual + y (decode_moe_mlp's residual).

  T k <= SMALL_BATCH_MAX_ASSIGNMENTS (the decode step): decode_moe_mlp on the module's stored weights,
  int8 and scales as they are; the compute-dtype copies passed in are then unused and XLA drops them.
  Otherwise (the prefill): moe_mlp on the weights passed in.
  """
  del capacity_factor
  if getattr(moe, "mesh", None) is not None:
    raise NotImplementedError("decoding runs on one device: build the model without a mesh for generation.")
  if expert_ids.shape[0] * expert_ids.shape[1] <= SMALL_BATCH_MAX_ASSIGNMENTS:
    w = expert_weights(moe, x.dtype, quantized=True)
    return decode_moe_mlp(x, expert_ids, combine_weights, w.pop("w_in"), w.pop("w_out"),
                          activation=activation, norm=norm, residual=residual, **w)
  if norm is not None:
    x = rms_norm(x, *norm)
  y, stats = moe_mlp(x, expert_ids, combine_weights, w_in, w_out, w_gate=w_gate, activation=activation,
                     capacity_factor=None, impl=impl)
  return (y if residual is None else residual + y.astype(residual.dtype)), stats
