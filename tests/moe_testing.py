"""Shared test helpers: the implementations under test, a float64 per-token loop, comparisons.

The numpy loop is the oracle the dense masked `moe_mlp_reference` is itself checked against; it
shares no code with the library (its own softmax, top-k, capacity count and activations).
"""
from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np

# Backends of grouped_matmul / dropless moe_mlp under test. Adding a backend is one line here.
IMPLS = ["reference", "ragged_dot", "pallas"]  # pallas runs in interpret mode off the GPU

# (jax activation, float64 numpy twin)
_GELU_C = math.sqrt(2.0 / math.pi)
ACTIVATIONS = {
    "gelu": (jax.nn.gelu, lambda v: 0.5 * v * (1.0 + np.tanh(_GELU_C * (v + 0.044715 * v**3)))),
    "silu": (jax.nn.silu, lambda v: v / (1.0 + np.exp(-v))),
}


def seed_of(*parts) -> int:
  """A stable seed per test case, so every case gets its own fresh random draws."""
  return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def rand(rng: np.random.Generator, shape, scale=1.0) -> np.ndarray:
  return (scale * rng.standard_normal(shape)).astype(np.float32)


def bf16_round(a: np.ndarray) -> np.ndarray:
  """The float32 values a bfloat16 cast keeps (so f32 references see the same inputs). On the host, rounded as
  jnp.asarray(a, jnp.bfloat16) rounds (through float32): a cast on the device compiled a program per shape."""
  return np.asarray(a, np.float32).astype(jnp.bfloat16).astype(np.float32)


# ---------------------------------------------------------------------------- numpy oracle
def np_top_k_routing(logits: np.ndarray, k: int, renormalize: bool | None = None):
  """softmax, then the k largest probabilities per token (ties broken by lower id)."""
  logits = np.asarray(logits, np.float64)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
  w = np.take_along_axis(p, ids, axis=-1)
  if renormalize is None:
    renormalize = k > 1
  if renormalize:
    w = w / w.sum(-1, keepdims=True)
  return ids, w, p


def np_capacity_keep(ids: np.ndarray, num_experts: int, capacity: int | None) -> np.ndarray:
  """keep[t, j]: id is a real expert and fewer than C earlier (token-major) assignments went there."""
  keep = np.zeros(ids.shape, bool)
  seen = [0] * num_experts
  for t in range(ids.shape[0]):
    for j in range(ids.shape[1]):
      e = int(ids[t, j])
      if not 0 <= e < num_experts:
        continue
      keep[t, j] = capacity is None or seen[e] < capacity
      seen[e] += 1
  return keep


def np_moe_loop(x, ids, weights, w_in, w_out, w_gate=None, act="gelu", capacity=None):
  """y[t] = sum over kept slots j of weights[t, j] * FFN_{ids[t, j]}(x[t]), token by token, in float64."""
  act_np = ACTIVATIONS[act][1]
  f64 = lambda a: None if a is None else np.asarray(a, np.float64)
  x, weights, w_in, w_out, w_gate = map(f64, (x, weights, w_in, w_out, w_gate))
  num_experts = w_in.shape[0]
  keep = np_capacity_keep(np.asarray(ids), num_experts, capacity)
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j in range(ids.shape[1]):
      if not keep[t, j]:
        continue
      e = int(ids[t, j])
      h = x[t] @ w_in[e]
      h = act_np(x[t] @ w_gate[e]) * h if w_gate is not None else act_np(h)
      y[t] += weights[t, j] * (h @ w_out[e])
  return y


# ---------------------------------------------------------------------------- comparisons
def assert_close(actual, expected, rtol, what="", scale=None):
  """Elementwise |a - b| <= rtol * (|b| + max|b|): relative to the output's scale, so entries
  near zero (cancellation) do not need an absolute tolerance of their own. `scale` overrides
  max|b| where the quantity's natural scale is another's (a gradient through a cancellation)."""
  a = np.asarray(jnp.asarray(actual).astype(jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(expected).astype(jnp.float32), np.float64)
  assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
  assert np.all(np.isfinite(a)), f"{what}: non-finite values"
  if scale is None:
    scale = float(np.max(np.abs(b))) if b.size else 0.0
  err = np.abs(a - b)
  bound = rtol * (np.abs(b) + scale) + 1e-30
  worst = float(np.max(err / bound)) if b.size else 0.0
  assert worst <= 1.0, (
      f"{what}: max error {float(err.max()):.3e} exceeds tolerance (rtol={rtol}, scale={scale:.3e})")


# ---------------------------------------------------------------------------- dot precision
def dot_precisions(fn, *args):
  """(primitive, precision, operand dtypes) of every dot_general / ragged_dot_general in fn's jaxpr,
  nested jaxprs (jit, custom_vjp, custom_vmap, shard_map, cond) included. On the CPU TF32 cannot be
  seen in the numbers, so the tests check that full precision is asked for where it must be."""
  from jax.extend import core as jcore

  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
        dtypes = tuple(str(v.aval.dtype) for v in eqn.invars[:2])
        found.append((eqn.primitive.name, eqn.params["precision"], dtypes))
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          if isinstance(sub, jcore.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jcore.Jaxpr):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


# Algorithms as accurate as a float32 dot (the router asks for six bf16 passes: _precision.py).
FLOAT32_ALGORITHMS = (jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6, jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                      jax.lax.DotAlgorithmPreset.F32_F32_F32)


def is_highest(precision) -> bool:
  """Whether a dot's precision parameter asks for full float32 on both operands (HIGHEST, or an
  algorithm of float32 accuracy)."""
  if precision is None:
    return False
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    return precision in FLOAT32_ALGORITHMS
  pair = precision if isinstance(precision, tuple) else (precision, precision)
  return all(p == jax.lax.Precision.HIGHEST for p in pair)


def jaxpr_equations(jaxpr):
  """Every equation of jaxpr and of the jaxprs inside its equations (remat regions, shard_map bodies, conds), to
  count what a traced program runs."""
  import jax.extend
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for sub in v if isinstance(v, (list, tuple)) else [v]:
        if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
          yield from jaxpr_equations(getattr(sub, "jaxpr", sub))


def loss_grads_and_kept_bytes(loss, params):
  """(loss(params), its gradients, bytes of what the backward keeps): jax.vjp's function holds exactly its
  residuals (and params). Jitted, as the vjp's function is a pytree: op by op, each small op compiled on its own."""
  value, vjp = jax.jit(lambda p: jax.vjp(loss, p))(params)
  kept = sum(a.nbytes for a in jax.tree.leaves(vjp)) - sum(a.nbytes for a in jax.tree.leaves(params))
  return value, jax.jit(lambda vjp, ct: vjp(ct))(vjp, jnp.ones_like(value))[0], kept
