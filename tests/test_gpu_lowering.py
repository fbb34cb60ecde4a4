"""The Pallas Triton kernels lower for a GPU, checked from the CPU.

Interpret mode runs a kernel's jaxpr with XLA's CPU ops, so it cannot tell whether Triton lowers every
primitive a kernel body uses (a sort, an erf, a reshape of a loaded block would pass here and fail on
the first GPU call). jax lowers for a platform it does not run on (lowering_platforms), so each kernel
is lowered for CUDA here; compiling and running them is tests_gpu/'s and the GPU runs of tests/.
"""
import jax
import jax.numpy as jnp
import pytest

from sparsejax.kernels.decode_attention import triton as attention
from sparsejax.kernels.decode_router import triton as router
from sparsejax.kernels.row_moves import triton as row_moves
from sparsejax.kernels.skinny_matmul import triton as skinny

bf16 = jnp.bfloat16


def _lowers(fn, *shapes):
  """fn lowers for CUDA with one Triton custom call or more."""
  args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") >= 1


@pytest.mark.parametrize("m,k,n", [(1, 1024, 4096), (1, 4096, 1024), (5, 256, 512)])
@pytest.mark.parametrize("norm", [False, True])
def test_skinny_matmul_lowers(m, k, n, norm):
  """Shared and per-slot rows, one row (multiply-reduce) and a dot's padded rows, int8 weights, the norm folded."""
  cfg = skinny.default_config(m, k, n)
  for per_slot, wdt in [(False, bf16), (True, jnp.int8)]:
    if per_slot and norm:
      continue
    shape = (2, m, k) if per_slot else (m, k)
    fn = lambda x, w, ids, g: skinny.skinny_matmul(x, w, ids, cfg, interpret=False,
                                                   norm=(g, 1e-6) if norm else None)
    _lowers(fn, (shape, bf16), ((4, k, n), wdt), ((2,), jnp.int32), ((k,), jnp.float32))


def test_decode_attention_lowers():
  fn = lambda q, k, v, s, i: attention.chunk_attention(q, k, v, s, i, interpret=False)
  _lowers(fn, ((2, 16, 64), bf16), ((2, 160, 16, 64), bf16), ((2, 160, 16, 64), bf16), ((2,), jnp.int32),
          ((), jnp.int32))


@pytest.mark.parametrize("norm", [False, True])
def test_decode_router_lowers(norm):
  cfg = router.default_config(1024, 64)
  fn = lambda x, w, g: router.decode_router(x, w, 1, False, cfg, interpret=False, norm=(g, 1e-6) if norm else None)
  _lowers(fn, ((1, 1024), bf16), ((1024, 64), jnp.float32), ((1024,), jnp.float32))


def test_row_gather_lowers():
  _lowers(lambda x, src: row_moves.gather_rows(x, src, interpret=False), ((512, 256), bf16), ((640,), jnp.int32))
