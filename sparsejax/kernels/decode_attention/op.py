"""decode_attention: one new query per row against the KV cache of a decode step.

  o[b, h] = softmax_j(q[b, h] . k[b, j, h] / sqrt(dh)) v[b, j, h], over the slots j the query sees:
            start[b] <= j <= index, or j == index (inference.kv_cache.mask's rule)
The query sits in slot `index` (already written into the cache). Backends: "triton" (triton.py; off the
GPU in interpret mode) and "xla" (reference.py); "auto" takes triton on a GPU when dh is a power of two
>= 16 and the cache has >= 16 slots, where this jax has Pallas' Triton backend. Differentiable: the
cotangents are the reference's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax import _checks
from sparsejax._precision import dot_precision
from sparsejax.kernels import auto_takes_triton, require_triton
from sparsejax.kernels._reference_vjp import with_reference_vjp
from sparsejax.kernels.decode_attention import triton
from sparsejax.kernels.decode_attention.reference import decode_attention_reference

IMPLS = ("auto", "triton", "xla")


def _kernel_fits(dh: int, slots: int) -> bool:
  return dh >= 16 and dh & (dh - 1) == 0 and slots >= triton.MIN_SLOTS


def _check(q, k_cache, v_cache, start, index, impl):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  if impl == "triton":
    require_triton("decode_attention(impl='triton')")
  _checks.check_rank("q", q, 3, "[batch, heads, head_dim]")
  _checks.check_rank("k_cache", k_cache, 4, "[batch, slots, heads, head_dim]")
  _checks.check_floating("q", q)
  if k_cache.shape != v_cache.shape:
    raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must have one shape.")
  b, _, h, dh = k_cache.shape
  if q.shape != (b, h, dh):
    raise ValueError(f"q must be [batch, heads, head_dim] = {(b, h, dh)} for this cache; got {q.shape}.")
  _checks.check_rank("start", start, 1, "[batch]")
  _checks.check_integer("start", start)
  if start.shape[0] != b:
    raise ValueError(f"start must have one entry per row ({b}); got {start.shape[0]}.")
  _checks.check_rank("index", index, 0, "[] (the query's slot)")
  _checks.check_integer("index", index)
  if impl == "triton" and not _kernel_fits(dh, k_cache.shape[1]):
    raise ValueError(f"impl='triton' needs head_dim a power of two >= 16 and >= {triton.MIN_SLOTS} cache slots; "
                     f"got head_dim {dh}, {k_cache.shape[1]} slots (use impl='auto').")


def _merge(part, stats, dtype):
  """o = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c, M = max_c m_c."""
  m, l = stats[..., 0], stats[..., 1]
  w = jnp.exp(m - jnp.max(m, axis=-1, keepdims=True))
  # The partials are float32 whatever q's dtype: HIGHEST for a float32 q (a GPU's default float32
  # dot is TF32), the default for bf16, as its programs always had.
  o = jnp.einsum("bhc,bhcd->bhd", w, part, precision=dot_precision(dtype))
  return (o / jnp.sum(w * l, axis=-1)[..., None]).astype(dtype)


def _split_kernel(q, k_cache, v_cache, start, index, cfg: triton.Config):
  out = triton.split_attention(q, k_cache, v_cache, start, index, cfg, interpret=jax.default_backend() != "gpu")
  return out if cfg.splits == 1 else _merge(*out, q.dtype)


def _kernel(q, k_cache, v_cache, start, index):
  b, slots, h, _ = k_cache.shape
  return _split_kernel(q, k_cache, v_cache, start, index, triton.default_config(b, h, slots))


def decode_attention(
    q: Float[Array, "b h dh"],
    k_cache: Float[Array, "b s h dh"],
    v_cache: Float[Array, "b s h dh"],
    start: Int[Array, "b"],
    index: Int[Array, ""],
    *,
    impl: str = "auto",
) -> Float[Array, "b h dh"]:
  """Softmax attention of the query in slot `index` over the slots it sees (module doc); q's dtype."""
  index = jnp.asarray(index)
  _check(q, k_cache, v_cache, start, index, impl)
  fits = _kernel_fits(q.shape[-1], k_cache.shape[1])
  if impl == "triton" or (impl == "auto" and jax.default_backend() == "gpu" and fits and auto_takes_triton()):
    return with_reference_vjp(_kernel, decode_attention_reference, q, k_cache, v_cache, start, index)
  return decode_attention_reference(q, k_cache, v_cache, start, index)
