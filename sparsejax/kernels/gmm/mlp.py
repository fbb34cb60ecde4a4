"""expert_mlp: y[r] = act(lhs[r] @ W_in[e(r)]) @ W_out[e(r)] on the block topology, one custom_vjp;
with W_gate the GLU form y[r] = (act(lhs[r] @ W_gate[e(r)]) * (lhs[r] @ W_in[e(r)])) @ W_out[e(r)].

On the Mosaic backend the activation lives in the kernels' epilogues, so no separate pass reads
or writes the [rows, d_ff] activations:
  forward   (d, h)   = gmm_act(lhs, W_in)          h = act(pre), d = act'(pre) of the float32 accumulator
            y        = gmm(h, W_out)
  backward  dpre     = gmm_dact(dy, W_out, d)      (dy W_out^T) * d
            dW_out = tgmm(h, dy), dW_in = tgmm(lhs, dpre), dlhs = gmm(dpre, W_in^T)
The backward needs pre only through act'(pre), so the forward, which evaluates the sigmoid that
act and act' share, stores act'(pre) (bf16) where it would store pre, and the backward multiplies
instead of evaluating exp and rsqrt again (mosaic.SaveDerivative). Where a config puts gmm_act or
gmm_dact on the epilogue warpgroup's kernel (which applies act or act' to the bf16 pre itself;
mosaic.saves_derivative), the forward stores pre and the backward takes act'(pre) of it.
GLU:
  forward   (g, u, h) = gmm_glu(lhs, W_gate, W_in)  two accumulators, h = act(g) * u
            y         = gmm(h, W_out)
  backward  (dg, du)  = gmm_dglu(dy, W_out, g, u)   (dh * u * act'(g), dh * act(g))
            dW_out = tgmm(h, dy), dW_gate = tgmm(lhs, dg), dW_in = tgmm(lhs, du),
            dlhs = gmm(dg, W_gate^T) + gmm(du, W_in^T)
Unfused, the activation costs a read of pre and a write of h forward, and a write and two reads
of dh plus a write of dpre backward. Other backends, float32 operands (which the Mosaic backend
hands to Triton) and activations outside FUSED compose op.gmm with the activation: same
contract, same answer.
Reference: reference.mlp_reference.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from sparsejax.kernels.gmm import op
from sparsejax.topology import Topology

# The activations the Mosaic epilogues apply (their derivatives: sparsejax.activations). Not
# exact GELU: Mosaic GPU (jax 0.11) has no layout rule for erf/erfc.
FUSED = (jax.nn.gelu, jax.nn.silu, jax.nn.relu)


def expert_mlp(
    lhs: Float[Array, "rows d_model"],
    w_in: Float[Array, "experts d_model d_ff"],
    w_out: Float[Array, "experts d_ff d_model"],
    topo: Topology,
    *,
    activation: Callable = jax.nn.gelu,
    backend: str = "auto",
    w_gate: Float[Array, "experts d_model d_ff"] | None = None,
) -> Float[Array, "rows d_model"]:
  """y[r] = act(lhs[r] @ w_in[e(r)]) @ w_out[e(r)] (with w_gate: act(lhs[r] @ w_gate[e(r)]) *
  (lhs[r] @ w_in[e(r)]) in place of act(...)) for real rows r, zero for the other rows of active
  blocks, unspecified in inactive blocks (op.py); differentiable in lhs and the weights.
  activation: an elementwise function of one array."""
  if w_out.shape != (w_in.shape[0], w_in.shape[2], w_in.shape[1]):
    raise ValueError(f"w_out must be [E, d_ff, d_model] = {(w_in.shape[0], w_in.shape[2], w_in.shape[1])}; "
                     f"got {w_out.shape}.")
  if w_gate is not None and (w_gate.shape != w_in.shape or w_gate.dtype != w_in.dtype):
    raise ValueError(f"w_gate must match w_in ({w_in.shape} {w_in.dtype}); got {w_gate.shape} {w_gate.dtype}.")
  backend = op.resolve_backend(backend)
  if backend != "mosaic" or lhs.dtype == jnp.float32 or activation not in FUSED:
    h = op.gmm(lhs, w_in, topo, backend=backend)
    h = activation(h) if w_gate is None else activation(op.gmm(lhs, w_gate, topo, backend=backend)) * h
    return op.gmm(h, w_out, topo, backend=backend)
  op._check(lhs, w_in, topo)
  if w_gate is None:
    return _fused(lhs, w_in, w_out, topo, activation)
  return _fused_glu(lhs, w_gate, w_in, w_out, topo, activation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(lhs, w_in, w_out, topo, activation):
  return _fused_fwd(lhs, w_in, w_out, topo, activation)[0]


def activation_forms(activation, rows: int, num_experts: int, configs=None) -> tuple:
  """(gmm_act's activation argument, gmm_dact's) as the fused MLP passes them at `rows` padded rows
  (the benchmarks time the kernels in the same forms): (SaveDerivative(act), None) where
  mosaic.saves_derivative allows, else (act, act)."""
  from sparsejax.kernels.gmm import mosaic
  if mosaic.saves_derivative(activation, rows, num_experts, configs):
    return mosaic.SaveDerivative(activation), None
  return activation, activation


def _fused_fwd(lhs, w_in, w_out, topo, activation):
  from sparsejax.kernels.gmm import mosaic
  forward, _ = activation_forms(activation, lhs.shape[0], topo.num_experts)
  pre, h = mosaic.gmm_act(lhs, w_in, topo, forward)
  y = mosaic.gmm(h, w_out, topo, False, lhs.dtype)
  return y, (lhs, w_in, w_out, topo, pre, h)  # pre: act'(pre) in the SaveDerivative form


def _fused_bwd(activation, res, dy):
  from sparsejax.kernels.gmm import mosaic
  lhs, w_in, w_out, topo, pre, h = res
  dy = dy.astype(lhs.dtype)
  _, backward = activation_forms(activation, lhs.shape[0], topo.num_experts)
  dpre = mosaic.gmm_dact(dy, w_out, topo, pre, backward)
  dw_out = mosaic.tgmm(h, dy, topo, w_out.dtype)
  dw_in = mosaic.tgmm(lhs, dpre, topo, w_in.dtype)
  dlhs = mosaic.gmm(dpre, w_in, topo, True, lhs.dtype)
  return dlhs, dw_in, dw_out, None


_fused.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused_glu(lhs, w_gate, w_in, w_out, topo, activation):
  return _fused_glu_fwd(lhs, w_gate, w_in, w_out, topo, activation)[0]


def _fused_glu_fwd(lhs, w_gate, w_in, w_out, topo, activation):
  from sparsejax.kernels.gmm import mosaic
  g, u, h = mosaic.gmm_glu(lhs, w_gate, w_in, topo, activation)
  y = mosaic.gmm(h, w_out, topo, False, lhs.dtype)
  return y, (lhs, w_gate, w_in, w_out, topo, g, u, h)


def _fused_glu_bwd(activation, res, dy):
  from sparsejax.kernels.gmm import mosaic
  lhs, w_gate, w_in, w_out, topo, g, u, h = res
  dy = dy.astype(lhs.dtype)
  dg, du = mosaic.gmm_dglu(dy, w_out, topo, g, u, activation)
  dw_out = mosaic.tgmm(h, dy, topo, w_out.dtype)
  dw_gate = mosaic.tgmm(lhs, dg, topo, w_gate.dtype)
  dw_in = mosaic.tgmm(lhs, du, topo, w_in.dtype)
  dx_gate = mosaic.gmm(dg, w_gate, topo, True, lhs.dtype)
  dx_in = mosaic.gmm(du, w_in, topo, True, lhs.dtype)
  dlhs = (dx_gate.astype(jnp.float32) + dx_in.astype(jnp.float32)).astype(lhs.dtype)
  return dlhs, dw_gate, dw_in, dw_out, None


_fused_glu.defvjp(_fused_glu_fwd, _fused_glu_bwd)
