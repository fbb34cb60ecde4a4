"""gmm / tgmm: one contract, one custom_vjp, several Pallas backends.

  gmm   out[r] = lhs[r] @ rhs[e(r)]          SDD (X W_in -> H) and DSD (H W_out -> Y) on the
                                              block-diagonal topology of sparsejax/topology.py
  gmm   transpose_rhs: lhs[r] @ rhs[e(r)]^T   D S D^T (dX = dH W_in^T, dH = dY W_out^T)
  tgmm  out[e] = sum_{r in e} lhs[r]^T dout[r]  DS^T D (dW_in = X^T dH, dW_out = H^T dY)
Rows that hold no token are zero in active blocks; rows of inactive blocks (row_block_rows 0)
are unspecified: the Hopper kernels leave them unwritten, because every consumer reads real rows
only (permute gathers by placement, and the kernels run zero steps on inactive blocks).
Backends: "triton" (triton.py, any CUDA GPU) and "mosaic" (mosaic.py, Hopper: TMA + wgmma,
warp-specialized, persistent); "auto" takes mosaic on sm_90.
Off the GPU both run in Pallas' interpret mode. The reference is reference.py. "xla" is XLA's
ragged_dot over the padded groups: where this jax has no Pallas Triton backend, what would run
Triton kernels runs it instead (resolve_backend).
"""
from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparsejax._precision import dot_precision
from sparsejax.kernels import auto_takes_triton, gpu_compute_capability as _gpu_compute_capability, require_triton
from sparsejax.kernels.gmm.reference import real_rows
from sparsejax.topology import BLOCK_SIZE, Topology, make_topology

BACKENDS = ("auto", "triton", "mosaic", "xla")


def _auto() -> str:
  """The Pallas backend for this device: Mosaic GPU on Hopper (sm_90), else Triton."""
  cc = _gpu_compute_capability()
  return "mosaic" if cc is not None and str(cc).startswith("9") else "triton"


def runs_triton(backend: str, dtype=None) -> bool:
  """Whether backend ("auto": the one it picks here) runs Pallas Triton kernels for operands of dtype: "triton"
  always, "mosaic" for float32, which it hands to Triton (dtype None: not float32)."""
  backend = _auto() if backend == "auto" else backend
  return backend == "triton" or (backend == "mosaic" and dtype is not None and jnp.dtype(dtype) == jnp.float32)


def resolve_backend(backend: str, dtype=None) -> str:
  """"auto": Mosaic GPU on Hopper (sm_90), Triton on other GPUs and (interpret mode) off the GPU. "xla" wherever
  that would run Triton kernels for dtype (runs_triton) that cannot run here: no Pallas Triton backend in this jax
  (where an explicit "triton" raises), or a GPU before sm_80 (where an explicit "triton" still runs them)."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}.")
  if backend == "triton":
    require_triton("gmm(backend='triton')", "backend='auto' or backend='xla'")
  resolved = _auto() if backend == "auto" else backend
  return "xla" if backend != "triton" and runs_triton(resolved, dtype) and not auto_takes_triton() else resolved


def _xla_group_rows(topo):
  """Rows of each expert's blocks: the padded groups, in order, as ragged_dot takes them."""
  return (jnp.diff(topo.expert_block_offsets) * topo.block_size).astype(jnp.int32)


def _xla_gmm(lhs, rhs, topo, transpose_rhs, out_dtype):
  """gmm by ragged_dot over the padded groups; rows that hold no token are zeroed (the kernels' contract)."""
  w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
  out = jax.lax.ragged_dot(lhs, w, _xla_group_rows(topo), precision=dot_precision(lhs.dtype),
                           preferred_element_type=jnp.float32)
  return jnp.where(real_rows(topo)[:, None], out, 0.0).astype(out_dtype)


def _xla_tgmm(lhs, dout, topo, out_dtype):
  """tgmm as ragged_dot_general with the rows (contracted) ragged: out[e] = lhs_e^T dout_e. dout's rows that
  hold no token may hold anything (tgmm's contract), so they are zeroed first."""
  dout = jnp.where(real_rows(topo)[:, None], dout, jnp.zeros((), dout.dtype))
  dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
                                           rhs_group_dimensions=[])
  out = jax.lax.ragged_dot_general(lhs, dout, _xla_group_rows(topo), dims, precision=dot_precision(lhs.dtype),
                                   preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


# The "xla" backend in the kernel modules' form (their gmm and tgmm), so the custom_vjp below serves it too.
_XLA = types.SimpleNamespace(gmm=_xla_gmm, tgmm=_xla_tgmm)


def _impl(backend: str):
  if backend == "mosaic":
    from sparsejax.kernels.gmm import mosaic
    return mosaic
  if backend == "xla":
    return _XLA
  from sparsejax.kernels.gmm import triton
  return triton


# The differentiable op. The cotangent of a transposed product is itself a (non-)transposed gmm
# and a tgmm, so both settings share one rule.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(lhs, rhs, topo, transpose_rhs, backend, out_dtype):
  return _impl(backend).gmm(lhs, rhs, topo, transpose_rhs, out_dtype)


def _gmm_fwd(lhs, rhs, topo, transpose_rhs, backend, out_dtype):
  return _gmm(lhs, rhs, topo, transpose_rhs, backend, out_dtype), (lhs, rhs, topo)


def _gmm_bwd(transpose_rhs, backend, out_dtype, res, dout):
  lhs, rhs, topo = res
  impl = _impl(backend)
  dout = dout.astype(lhs.dtype)
  dlhs = impl.gmm(dout, rhs, topo, not transpose_rhs, lhs.dtype)
  if transpose_rhs:  # out = lhs rhs^T: drhs[e] = dout_e^T lhs_e
    drhs = impl.tgmm(dout, lhs, topo, rhs.dtype)
  else:
    drhs = impl.tgmm(lhs, dout, topo, rhs.dtype)
  return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _check(lhs, rhs, topo):
  if lhs.shape[0] != topo.num_row_blocks * topo.block_size:
    raise ValueError(f"lhs has {lhs.shape[0]} rows; the topology covers "
                     f"{topo.num_row_blocks} blocks of {topo.block_size}.")
  if rhs.shape[0] != topo.num_experts:
    raise ValueError(f"rhs has {rhs.shape[0]} experts; the topology has {topo.num_experts}.")


def gmm(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "experts k n"] | Float[Array, "experts n k"],
    topo: Topology,
    *,
    transpose_rhs: bool = False,
    backend: str = "auto",
    out_dtype=None,
) -> Float[Array, "rows n"]:
  """out[r] = lhs[r] @ rhs[e(r)] (rhs[e(r)]^T with transpose_rhs) for real rows r, zero for the
  other rows of active blocks, unspecified in inactive blocks; float32 accumulation, out_dtype
  (default lhs.dtype) output; differentiable in lhs and rhs."""
  _check(lhs, rhs, topo)
  return _gmm(lhs, rhs, topo, transpose_rhs, resolve_backend(backend, lhs.dtype),
              jnp.dtype(out_dtype or lhs.dtype))


def tgmm(
    lhs: Float[Array, "rows k"],
    dout: Float[Array, "rows n"],
    topo: Topology,
    *,
    backend: str = "auto",
    out_dtype=None,
) -> Float[Array, "experts k n"]:
  """out[e] = sum over active rows r of expert e of lhs[r]^T dout[r] (the weight gradient). The
  rows of dout that hold no token may hold anything, NaN included: they are left out of the sum.
  lhs's must be finite there (the Mosaic backend zeroes dout's only; every caller's are zero)."""
  if lhs.shape[0] != dout.shape[0]:
    raise ValueError(f"lhs has {lhs.shape[0]} rows but dout has {dout.shape[0]}.")
  _check(lhs, jnp.zeros((topo.num_experts,)), topo)
  return _impl(resolve_backend(backend, lhs.dtype)).tgmm(lhs, dout, topo, jnp.dtype(out_dtype or lhs.dtype))


def grouped_matmul_padded(
    lhs: Float[Array, "rows k"],
    rhs: Float[Array, "groups k n"],
    group_sizes: Int[Array, "groups"],
    *,
    backend: str = "auto",
    out_dtype=None,
    block_size: int = BLOCK_SIZE,
) -> Float[Array, "rows n"]:
  """ragged_dot semantics through the padded kernels: rows moved into block-padded groups and back."""
  from sparsejax.permute import dropless_num_rows

  num_rows, num_groups = lhs.shape[0], rhs.shape[0]
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  padded = (group_sizes + block_size - 1) // block_size * block_size
  padded_starts = jnp.cumsum(padded) - padded
  row = jnp.arange(num_rows, dtype=jnp.int32)
  # compare_all: no while loop (topology.make_topology says why).
  group = jnp.minimum(jnp.searchsorted(ends, row, side="right", method="compare_all"), num_groups - 1)
  valid = row < ends[-1]
  rows_bound = dropless_num_rows(num_rows, num_groups, block_size)
  dest = jnp.where(valid, padded_starts[group] + row - starts[group], rows_bound)
  src = jnp.full((rows_bound,), num_rows, jnp.int32).at[dest].set(row, mode="drop")
  lhs_ext = jnp.concatenate([lhs, jnp.zeros((1, lhs.shape[1]), lhs.dtype)])
  topo = make_topology(padded, rows_bound, block_size, group_sizes)
  out = gmm(lhs_ext[src], rhs, topo, backend=backend, out_dtype=out_dtype)
  out_ext = jnp.concatenate([out, jnp.zeros((1, out.shape[1]), out.dtype)])
  return out_ext[dest]
