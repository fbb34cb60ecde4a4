"""l2_prefetch: a hint that changes no value. Interpret mode skips it; for CUDA it lowers to one inline-asm L2
prefetch per line of the array, and the routed row kernel asks for its `prefetch` arrays without changing a value."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from sparsejax.activations import PLAIN
from sparsejax.kernels import l2_prefetch
from sparsejax.kernels.skinny_matmul import op as skinny_op
from sparsejax.kernels.skinny_matmul import triton as skinny
from sparsejax.kernels.skinny_matmul import triton_row_ffn as row_ffn


def _doubling(programs: int, interpret: bool):
  def kernel(x_ref, w_ref, o_ref):
    l2_prefetch.prefetch_share(w_ref, pl.program_id(0), programs)
    o_ref[...] = x_ref[...] * 2

  return lambda x, w: pl.pallas_call(
      kernel, grid=(programs,), in_specs=[pl.BlockSpec((16,), lambda i: (i,)), pl.no_block_spec],
      out_specs=pl.BlockSpec((16,), lambda i: (i,)), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      interpret=interpret, compiler_params=None if interpret else plt.CompilerParams(num_warps=4))(x, w)


def test_interpret_mode_skips_the_prefetch():
  x = jax.random.normal(jax.random.key(0), (64,), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (300, 70), jnp.bfloat16)
  np.testing.assert_array_equal(_doubling(4, True)(x, w), 2 * x)


def test_cuda_lowering_asks_l2_for_the_array():
  x, w = jax.ShapeDtypeStruct((64,), jnp.float32), jax.ShapeDtypeStruct((300, 70), jnp.bfloat16)
  text = jax.jit(_doubling(4, False)).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("prefetch.global.L2::evict_last") == 1


@pytest.mark.parametrize("total,programs,want", [(1, 4, 1), (4, 4, 1), (5, 4, 2), (384, 128, 4), (49152, 128, 512),
                                                 (49153, 128, 512)])
def test_lines_per_program_cover_the_array(total, programs, want):
  """A power of two a program, and the programs that ask (those whose first line is inside) cover every line."""
  lines = l2_prefetch.lines_per_program(total, programs)
  assert lines == want
  asking = -(-total // lines)
  assert asking <= programs and asking * lines >= total


def test_routed_row_kernel_with_prefetch_keeps_its_values():
  """routed_ffn_residual with prefetch arrays returns what it returns without them, and they get no gradient."""
  d, f, e, s = 32, 128, 4, 2
  ks = jax.random.split(jax.random.key(2), 6)
  x = jax.random.normal(ks[0], (1, d), jnp.float32)
  w_in = jax.random.normal(ks[1], (e, d, f), jnp.float32) / d ** 0.5
  w_out = jax.random.normal(ks[2], (e, f, d), jnp.float32) / f ** 0.5
  parts = jax.random.normal(ks[3], (1, s, e), jnp.float32)
  residual = jax.random.normal(ks[4], (1, d), jnp.float32)
  extra = jax.random.normal(ks[5], (96, 3, 4, 8), jnp.bfloat16)
  run = lambda pre: skinny_op.routed_ffn_residual(x, parts, w_in, w_out, residual, k=2, renormalize=True,
                                                  prefetch=pre, impl="triton")
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(row_ffn, "MIN_PROGRAMS", 1)
    assert skinny_op.fuses_routing(d, f, jax.nn.gelu, "triton", 2, s, w_in, None, w_out)
    (y0, ids0), (y1, ids1) = run(()), run((extra,))
    grad = jax.grad(lambda pre: run(pre)[0].sum())((extra,))
  np.testing.assert_array_equal(y0, y1)
  np.testing.assert_array_equal(ids0, ids1)
  assert not np.asarray(grad[0], np.float32).any()


def test_routed_row_kernel_lowers_with_its_prefetch():
  """Medium's shapes: 128 programs ask for a 6 MB W_qkv, 384 lines each; the prefetch sits once in the kernel."""
  bf16, g = jnp.bfloat16, jnp.float32

  def fn(x, ns, w_in, w_out, rp, w_qkv):
    return row_ffn.row_ffn_parts((x, ns), skinny.Normed(1e-6), w_in, None, w_out, None, None, rp,
                                 PLAIN[jax.nn.gelu], bf16, row_ffn.Routed(1, False), prefetch=(w_qkv,),
                                 interpret=False)

  shapes = [((1, 1024), bf16), ((1024,), g), ((64, 1024, 4096), bf16), ((64, 4096, 1024), bf16), ((1, 8, 64), g),
            ((1024, 3, 16, 64), bf16)]
  args = [jax.ShapeDtypeStruct(s, t) for s, t in shapes]
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("prefetch.global.L2::evict_last") == 1
