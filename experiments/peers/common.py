"""What every peer of the MoE benchmark shares: the problem, its float32 reference, the check, the timer.

The problem is the expert MLP of one MoE layer, y[r] = gelu(x[r] W_in[e(r)]) W_out[e(r)], on the
N = T*k rows that routing sends to the experts, sorted by expert (the dropless rows). Every peer
gets the same bf16 data, lays it out its own way (padded blocks, equal groups, a capacity buffer,
a torch tensor) outside the timed call, and maps its outputs back for the check.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from sparsejax import permute

# bf16 operands, float32 accumulation: measured errors are ~3e-3 (forward) and ~5e-3 (gradients).
# A broken kernel lands near 1; these leave room for rounding and nothing more.
OUT_TOL = 2e-2
GRAD_TOL = 3e-2
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  T: int  # tokens
  d: int  # model width
  f: int  # expert hidden width
  E: int  # experts
  k: int  # experts per token
  skewed: bool  # routing: uniform, or expert i with probability ~ (i+1)^-0.5

  @property
  def N(self) -> int:
    return self.T * self.k


@dataclasses.dataclass
class Problem:
  """One shape's data, bf16 on the default device. rows/ct are in the sorted (dropless) layout."""
  shape: Shape
  x: Float[Array, "T d"]
  ids: Int[Array, "T k"]
  w_in: Float[Array, "E d f"]
  w_out: Float[Array, "E f d"]
  counts: np.ndarray  # [E] rows of each expert (host)
  rows: Float[Array, "N d"]  # x's rows sorted by expert, unpadded
  ct: Float[Array, "N d"]  # the cotangent of the expert outputs: fixed, random, never zeros
  group_sizes: Int[Array, "E"]  # counts, on the device


def routing_ids(key, T: int, E: int, k: int, skewed: bool) -> Int[Array, "T k"]:
  """Expert ids [T, k], distinct per token: Gumbel top-k samples k experts without replacement
  from the uniform or the (i+1)^-0.5 distribution."""
  logits = jnp.zeros((E,)) if not skewed else -0.5 * jnp.log(jnp.arange(1, E + 1, dtype=jnp.float32))
  g = jax.random.gumbel(key, (T, E)) + logits
  return jax.lax.top_k(g, k)[1].astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _problem_arrays(s: Shape, dtype, key):
  keys = jax.random.split(key, 5)
  x = jax.random.normal(keys[0], (s.T, s.d), dtype)
  w_in = (jax.random.normal(keys[1], (s.E, s.d, s.f), jnp.float32) / math.sqrt(s.d)).astype(dtype)
  w_out = (jax.random.normal(keys[2], (s.E, s.f, s.d), jnp.float32) / math.sqrt(s.f)).astype(dtype)
  ids = routing_ids(keys[3], s.T, s.E, s.k, s.skewed)
  placement = permute.dropless_placement(ids, s.E)
  rows = permute.gather_rows(x, placement)
  ct = jax.random.normal(keys[4], (s.N, s.d), dtype)
  return x, ids, w_in, w_out, placement.tokens_per_expert, rows, ct


def make_problem(s: Shape, dtype=jnp.bfloat16, seed: int = 0) -> Problem:
  x, ids, w_in, w_out, counts, rows, ct = _problem_arrays(s, jnp.dtype(dtype), jax.random.key(seed))
  return Problem(s, x, ids, w_in, w_out, np.asarray(counts), rows, ct, counts.astype(jnp.int32))


def mlp(mm: Callable, rows, w_in, w_out):
  """mm(gelu(mm(rows, w_in)), w_out) for any grouped product mm."""
  return mm(jax.nn.gelu(mm(rows, w_in)), w_out)


def einsum_mm(a, w):
  """The batched product of E groups: [E, C, K] x [E, K, M] -> [E, C, M]."""
  return jnp.einsum("eck,ekm->ecm", a, w)


@dataclasses.dataclass
class Reference:
  """Float32 forward output, hidden pre-activation and gradients (x rows, W_in, W_out) for ct."""
  y: Any
  h: Any
  dx: Any
  dw_in: Any
  dw_out: Any


def batched_reference(buf: Float[Array, "E C d"], ct: Float[Array, "E C d"], w_in, w_out) -> Reference:
  """The expert MLP on E equal groups in float32 (HIGHEST precision) and its vjp."""
  mm = lambda a, w: jnp.einsum("eck,ekm->ecm", a, w, precision=HIGHEST)
  f32 = lambda a: a.astype(jnp.float32)

  @jax.jit
  def run(buf, ct, w_in, w_out):
    h = mm(buf, w_in)
    y, vjp = jax.vjp(lambda b, wi, wo: mlp(mm, b, wi, wo), buf, w_in, w_out)
    return (y, h, *vjp(ct))

  return Reference(*run(f32(buf), f32(ct), f32(w_in), f32(w_out)))


def to_groups(rows: Float[Array, "N d"], counts: np.ndarray) -> tuple[Array, np.ndarray]:
  """Sorted rows -> [E, max count, d] (zero-padded) and the flat index of each sorted row in it."""
  E, cmax = len(counts), max(1, int(counts.max()))
  starts = np.cumsum(counts) - counts
  expert = np.repeat(np.arange(E), counts)
  pos = expert * cmax + np.arange(len(expert)) - starts[expert]
  buf = _scatter_rows(rows, jnp.asarray(pos), E * cmax)
  return buf.reshape(E, cmax, -1), pos


@functools.partial(jax.jit, static_argnums=2)
def _scatter_rows(rows, pos, num_rows):
  return jnp.zeros((num_rows, rows.shape[1]), rows.dtype).at[pos].set(rows)


def dropless_reference(p: Problem) -> Reference:
  """Obviously right: each expert's rows gathered into a zero-padded [E, max count, d] batch, the
  float32 batched MLP on it, and the results gathered back to the sorted rows."""
  buf, pos = to_groups(p.rows, p.counts)
  ct_buf, _ = to_groups(p.ct, p.counts)
  r = batched_reference(buf, ct_buf, p.w_in, p.w_out)
  back = jax.jit(lambda a, pos: a.reshape(-1, a.shape[-1])[pos])
  pos = jnp.asarray(pos)
  return Reference(back(r.y, pos), back(r.h, pos), back(r.dx, pos), r.dw_in, r.dw_out)


@jax.jit
def _rel_err(got, want):
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  return jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30)


def rel_err(got, want) -> float:
  """||got - want|| / ||want|| in float32, on the device; NaN if got has a NaN."""
  return float(_rel_err(jnp.asarray(got), jnp.asarray(want)))


def compare(y, grads, ref: Reference) -> dict:
  """Record entries for one variant: rel_err (output), grad_rel_err (x rows, W_in, W_out), check_ok."""
  out = {"rel_err": rel_err(y, ref.y)}
  ok = out["rel_err"] < OUT_TOL
  if grads is not None:
    errs = [rel_err(g, w) for g, w in zip(grads, (ref.dx, ref.dw_in, ref.dw_out))]
    out["grad_rel_err"] = errs
    ok = ok and all(e < GRAD_TOL for e in errs)
  out["check_ok"] = bool(ok)  # NaN compares False: a NaN fails
  return out


@dataclasses.dataclass
class Case:
  """One timed variant. fwd/fwdbwd launch one call (asynchronously) and return what `sync` waits
  for; check() runs both once, compares them with the reference, and returns record entries."""
  variant: str
  fwd: Callable[[], Any]
  fwdbwd: Callable[[], Any] | None
  sync: Callable[[Any], Any]
  check: Callable[[], dict]
  useful_rows: int
  info: dict = dataclasses.field(default_factory=dict)


def fwd_bwd(f: Callable, ct) -> Callable:
  """args -> (y, d<y, ct>/d args) for y = f(*args): y is returned beside the gradients. A jax.grad
  of sum(y * ct) never needs y, so XLA would drop the forward's last product as dead code and skip
  a sixth of the FLOPs that torch's backward pass runs. In training the cotangent comes from y
  (through the layers above), so the backward starts after the forward: without the barrier XLA
  may start dY W_out^T first and merge the forward and backward activation passes into one,
  which no training step can do."""
  def run(*args):
    y, vjp = jax.vjp(f, *args)
    y, c = jax.lax.optimization_barrier((y, ct.astype(y.dtype)))
    return y, vjp(c)
  return run


def jax_case(variant: str, f: Callable, args: tuple, ct, useful_rows: int, check_outputs: Callable,
             **info) -> Case:
  """A Case for a JAX function f(rows, *rest, w_in, w_out) differentiated in rows, w_in and w_out.

  check_outputs(y, (d_rows, d_w_in, d_w_out)) -> record entries (maps the variant's layout back).
  The forward+backward is fwd_bwd with the fixed cotangent ct (no extra loss reduction)."""
  rows, *rest, w_in, w_out = args
  rest = tuple(rest)  # layout operands (group sizes, topology): jit arguments, not constants
  fwd = jax.jit(f)

  def fwdbwd(rows, rest, w_in, w_out, ct):
    return fwd_bwd(lambda r, wi, wo: f(r, *rest, wi, wo), ct)(rows, w_in, w_out)

  fb = jax.jit(fwdbwd)

  def check():
    y, grads = fb(rows, rest, w_in, w_out, ct)
    return check_outputs(y, grads)

  return Case(variant, lambda: fwd(*args), lambda: fb(rows, rest, w_in, w_out, ct),
              jax.block_until_ready, check, useful_rows, info)


def time_fn(f, *args, warmup, iters):
  """Median wall seconds of f(*args), each call blocked on, after warm-up calls (compile included there)."""
  for _ in range(warmup):
    jax.block_until_ready(f(*args))
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


@dataclasses.dataclass(frozen=True)
class Timer:
  """The one timer of every peer (JAX and torch alike).

  After `warmup` synchronized calls, `iters` is grown until `iters` back-to-back asynchronous calls
  followed by one sync take at least `min_repeat_s` of wall time; then `repeats` such repeats are
  timed. A call's time is the median over repeats of (repeat wall time) / iters. The queue of
  asynchronous calls keeps the GPU busy while the host launches the next ones, so host launch
  overhead is hidden as long as a call's device time exceeds its launch time; the one sync per
  repeat costs at most a few microseconds over >= 20 ms."""
  min_repeat_s: float = 0.02
  repeats: int = 7
  warmup: int = 2
  max_iters: int = 10_000

  def __call__(self, fn: Callable[[], Any], sync: Callable[[Any], Any]) -> dict:
    for _ in range(self.warmup):
      sync(fn())
    iters = 1
    while True:  # calibrate: grow iters until one repeat lasts min_repeat_s
      elapsed = self._repeat(fn, sync, iters)
      if elapsed >= self.min_repeat_s or iters >= self.max_iters:
        break
      iters = min(self.max_iters, math.ceil(iters * 1.25 * self.min_repeat_s / max(elapsed, 1e-7)))
    times = [self._repeat(fn, sync, iters) / iters for _ in range(self.repeats)]
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "iters": iters, "repeats": self.repeats}

  @staticmethod
  def _repeat(fn, sync, iters) -> float:
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
      out = fn()
    sync(out)
    return time.perf_counter() - t0


SMOKE_TIMER = Timer(min_repeat_s=0.0, repeats=1, warmup=0)
