"""launch_dependents: a launch-order hint that changes no value. Interpret mode runs the kernel as it is; for CUDA
every program triggers once, and the EARLY switch, patched, reaches a kernel that shared_lowering lowered before."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from sparsejax.kernels import launch_dependents
from sparsejax.kernels.decode_attention import triton as attention

TRIGGER = "griddepcontrol.launch_dependents"


def _doubling(interpret: bool):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  return lambda x: pl.pallas_call(
      launch_dependents.early(kernel, interpret, "doubling"), grid=(4,), in_specs=[pl.BlockSpec((16,), lambda i: (i,))],
      out_specs=pl.BlockSpec((16,), lambda i: (i,)), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      interpret=interpret, compiler_params=None if interpret else plt.CompilerParams(num_warps=4))(x)


def test_interpret_mode_runs_the_kernel_as_it_is():
  x = jax.random.normal(jax.random.key(0), (64,), jnp.float32)
  np.testing.assert_array_equal(_doubling(True)(x), 2 * x)


def test_cuda_lowering_triggers_once_a_kernel(monkeypatch):
  monkeypatch.setattr(launch_dependents, "EARLY", ("doubling",))
  text = jax.jit(_doubling(False)).trace(jax.ShapeDtypeStruct((64,), jnp.float32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count(TRIGGER) == 1


def test_the_switch_reaches_a_kernel_already_lowered(monkeypatch):
  """An A-B traces B with EARLY patched after A was lowered: shared_lowering's jit keys on the switch, so B's
  kernel is traced anew (without the key the nested jit handed back A's kernel, trigger and all)."""
  bf16 = jnp.bfloat16
  shapes = [((1, 16, 64), bf16), ((1, 160, 16, 64), bf16), ((1, 160, 16, 64), bf16), ((1,), jnp.int32),
            ((), jnp.int32)]
  args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]

  def triggers():
    cfg = attention.default_config(1, 16, 160)
    fn = lambda q, k, v, s, i: attention.split_attention(q, k, v, s, i, cfg, interpret=False)  # a new outer trace
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text().count(TRIGGER)

  assert triggers() == 1  # the default: the attention is one of the small kernels that trigger
  for early, want in [(False, 0), (("sparsejax_skinny_matmul",), 0), (True, 1), (False, 0)]:
    monkeypatch.setattr(launch_dependents, "EARLY", early)
    assert triggers() == want, early


@pytest.mark.parametrize("cc,want", [(None, 1), ("9.0", 1), ("10.0", 1), ("8.0", 0), ("8.9", 0)])
def test_gpus_before_hopper_never_trigger(monkeypatch, cc, want):
  """griddepcontrol is sm_90 PTX: on an Ampere or Ada GPU the kernels lower without it (None: off the GPU, lowered
  for CUDA as a Hopper would run it)."""
  monkeypatch.setattr(launch_dependents, "EARLY", True)
  monkeypatch.setattr(launch_dependents, "_compute_capability", lambda: cc)
  text = jax.jit(_doubling(False)).trace(jax.ShapeDtypeStruct((64,), jnp.float32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count(TRIGGER) == want
