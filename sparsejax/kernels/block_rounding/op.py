"""block_moves: which assignments token rounding drops and which next choices it adds, expert by expert.

With c_e the assignments to expert e, r_e = c_e mod b, and the candidates of e the tokens whose next choice (their
likeliest expert outside their picks) is e: an expert with c_e >= b and r_e > 0 adds b - r_e candidates when
2 r_e >= b and it has that many (its b - r_e of highest p[t, e], ties to the lower token), else drops r_e
assignments (its r_e of lowest p[t, e], ties to the higher token first); every other expert keeps what it has.
keep[t, j]: assignment (t, j) stays; add[t]: token t takes nxt[t]. Equal to ranking every expert's items by one
sort (reference.py), which is what rounding cost on a GPU: XLA's sort of the T k + T items is many kernels
(notes_hopper_kernels.md, fifty-third session).
With axis_name (inside shard_map or vmap), every device along it holds its own tokens, and the moves are those of the
group's tokens concatenated in axis order, ties to the lower group index: each device gets its rows.
Backends: "triton" (triton.py; off the GPU in interpret mode) and "xla" (reference.py); "auto" takes triton on a
GPU where this jax has Pallas' Triton backend. The moves are discrete: no gradient.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from sparsejax.kernels import auto_takes_triton, require_triton
from sparsejax.kernels.block_rounding import triton
from sparsejax.kernels.block_rounding.reference import block_moves_reference, group_moves_reference

IMPLS = ("auto", "triton", "xla")


def runs_kernel(impl: str = "auto") -> bool:
  """Whether block_moves runs the Pallas kernel: impl "triton", or "auto" on a GPU with Pallas' Triton backend."""
  return impl == "triton" or (impl == "auto" and jax.default_backend() == "gpu" and auto_takes_triton())


def block_moves(probs: Float[Array, "tokens experts"], expert: Int[Array, "tokens k"], nxt: Int[Array, "tokens"],
                block: int, *, impl: str = "auto", axis_name=None
                ) -> tuple[Bool[Array, "tokens k"], Bool[Array, "tokens"]]:
  """(keep, add) of token rounding to multiples of `block` (module doc). probs: float32, >= 0; expert and nxt:
  ids in [0, E], E for none (a slot without an expert; a token with no expert left to take); a token's experts
  distinct. axis_name: a mesh or vmap axis, or a tuple of them, whose devices' tokens are rounded together."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
  if impl == "triton":
    require_triton("block_moves(impl='triton')", "impl='auto' or impl='xla'")
  probs = jax.lax.stop_gradient(probs).astype(jnp.float32)
  probs = jnp.where(probs == 0, 0.0, probs)  # -0.0 as +0.0: the kernel orders scores by their bits
  num_experts = probs.shape[1]
  none = lambda a: jnp.where((a >= 0) & (a < num_experts), a, num_experts).astype(jnp.int32)
  expert, nxt = none(expert), none(nxt)
  interpret = jax.default_backend() != "gpu"
  if axis_name is not None:
    if runs_kernel(impl):
      return triton.group_moves(probs, expert, nxt, block, axis_name, interpret=interpret)
    return group_moves_reference(probs, expert, nxt, block, axis_name)
  if runs_kernel(impl):
    return triton.block_moves(probs, expert, nxt, block, interpret=interpret)
  return block_moves_reference(probs, expert, nxt, block)
