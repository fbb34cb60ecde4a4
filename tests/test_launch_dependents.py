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
from sparsejax.kernels.pallas_triton_gpu import lower_for_gpu

TRIGGER = "griddepcontrol.launch_dependents"


def _doubling(interpret: bool, traced_for_gpu: bool | None = None):
  """traced_for_gpu: whether early() sees a compiled kernel (default: not interpret)."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  compiled = not interpret if traced_for_gpu is None else traced_for_gpu
  return lambda x: pl.pallas_call(
      launch_dependents.early(kernel, not compiled, "doubling"), grid=(4,),
      in_specs=[pl.BlockSpec((16,), lambda i: (i,))], out_specs=pl.BlockSpec((16,), lambda i: (i,)),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      interpret=interpret, compiler_params=None if interpret else plt.CompilerParams(num_warps=4))(x)


def test_interpret_mode_runs_the_kernel_as_it_is():
  x = jax.random.normal(jax.random.key(0), (64,), jnp.float32)
  np.testing.assert_array_equal(_doubling(True)(x), 2 * x)


def test_the_trigger_discharges_to_nothing(monkeypatch):
  """A kernel body that holds the trigger, run by the interpreter, which discharges it (jax 0.10 calls the
  discharge rule with the avals, 0.11 with a context): the values are the kernel's."""
  monkeypatch.setattr(launch_dependents, "EARLY", True)
  x = jax.random.normal(jax.random.key(1), (64,), jnp.float32)
  assert "sparsejax_launch_dependents" in str(jax.make_jaxpr(_doubling(True, traced_for_gpu=True))(x))
  np.testing.assert_array_equal(_doubling(True, traced_for_gpu=True)(x), 2 * x)


def test_cuda_lowering_triggers_once_a_kernel(monkeypatch):
  monkeypatch.setattr(launch_dependents, "EARLY", ("doubling",))
  text = lower_for_gpu(_doubling(False), jax.ShapeDtypeStruct((64,), jnp.float32)).as_text()
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
    return lower_for_gpu(fn, *args).as_text().count(TRIGGER)

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
  text = lower_for_gpu(_doubling(False), jax.ShapeDtypeStruct((64,), jnp.float32)).as_text()
  assert text.count(TRIGGER) == want
