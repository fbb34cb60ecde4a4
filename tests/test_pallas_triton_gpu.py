"""pallas_triton_gpu: the GPU a Pallas Triton kernel lowers for, where jax (0.11) looks it up by device kind.

The table's logic is checked against a stand-in table on any jax; the last tests use jax's own table, which only
jax >= 0.11 has (jax 0.10 reads the capability from the device and needs none of this)."""
import dataclasses
import types
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from sparsejax import kernels
from sparsejax.kernels import pallas_triton_gpu

RTX_4080 = "NVIDIA GeForce RTX 4080"
X = jax.ShapeDtypeStruct((16, 16), jnp.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Info:
  gpu_version: object
  arch_name: str
  compute_capability: int


def _stand_in_table(known=("NVIDIA H100",), info=_Info):
  """The three names pallas_triton_gpu reads from jax's gpu_info, knowing kinds that start with `known`."""
  return types.SimpleNamespace(
      registry={}, GpuInfo=info,
      gpu_version_from_device_kind=lambda kind: next((k for k in known if kind.startswith(k)), None))


@pytest.fixture(autouse=True)
def _fresh_device_entry():
  """register_device_gpu is once a process: each test that reads a device of its own starts and ends unentered."""
  pallas_triton_gpu.register_device_gpu.cache_clear()
  yield
  pallas_triton_gpu.register_device_gpu.cache_clear()


def _later_gpu_info(**kwargs):  # a later jax whose GpuInfo takes other fields
  raise TypeError("unexpected keyword argument 'gpu_version'")


@pytest.fixture
def table(monkeypatch):
  t = _stand_in_table()
  monkeypatch.setattr(pallas_triton_gpu, "_gpu_table", lambda: t)
  return t


@pytest.mark.parametrize("cc,number", [("8.9", 89), ("8.6", 86), ("10.0", 100), ("12.1", 121)])
def test_an_unknown_kind_is_entered_with_its_own_capability(table, cc, number):
  assert not pallas_triton_gpu.knows_gpu(RTX_4080)
  pallas_triton_gpu.register_gpu(RTX_4080, cc)
  assert pallas_triton_gpu.knows_gpu(RTX_4080)
  assert table.registry[RTX_4080]() == _Info(gpu_version=None, arch_name=cc, compute_capability=number)


def test_a_kind_the_table_has_keeps_jax_s_entry(table):
  pallas_triton_gpu.register_gpu("NVIDIA H100 80GB HBM3", "8.0")
  pallas_triton_gpu.register_gpu(RTX_4080, "8.9")
  pallas_triton_gpu.register_gpu(RTX_4080, "9.0")  # entered already: the first entry stays
  assert set(table.registry) == {RTX_4080} and table.registry[RTX_4080]().compute_capability == 89


@pytest.mark.parametrize("cc", ["89", "8.9.1", "sm_89", "gfx90a"])
def test_a_capability_not_major_dot_minor_is_a_one_line_error(table, cc):
  with pytest.raises(ValueError, match="compute_capability must read 'major.minor'") as e:
    pallas_triton_gpu.register_gpu(RTX_4080, cc)
  assert "\n" not in str(e.value)


def test_a_jax_without_the_table_needs_nothing(monkeypatch):
  monkeypatch.setattr(pallas_triton_gpu, "_gpu_table", lambda: None)
  assert pallas_triton_gpu.knows_gpu("no such card")
  pallas_triton_gpu.register_gpu("no such card", "8.9")  # nothing to enter, nothing raised


def _on_gpu(monkeypatch, kind, cc):
  """The default device reads as a CUDA GPU of this kind to pallas_triton_gpu (register_device_gpu anew)."""
  monkeypatch.setattr(pallas_triton_gpu, "default_gpu", lambda: (kind, cc))
  pallas_triton_gpu.register_device_gpu.cache_clear()


def test_auto_takes_triton_on_a_gpu_the_table_lacks_once_it_is_entered(table, monkeypatch):
  _on_gpu(monkeypatch, RTX_4080, "8.9")
  assert kernels.auto_takes_triton()
  assert table.registry[RTX_4080]().compute_capability == 89


def test_auto_takes_xla_with_one_warning_where_the_gpu_cannot_be_entered(monkeypatch):
  t = _stand_in_table(info=_later_gpu_info)
  monkeypatch.setattr(pallas_triton_gpu, "_gpu_table", lambda: t)
  _on_gpu(monkeypatch, RTX_4080, "8.9")
  kernels._warn_unknown_gpu.cache_clear()
  try:
    with pytest.warns(RuntimeWarning, match="does not know the GPU 'NVIDIA GeForce RTX 4080'"):
      assert not kernels.auto_takes_triton()
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      assert not kernels.auto_takes_triton()  # once a process
  finally:
    kernels._warn_unknown_gpu.cache_clear()


def test_lookup_says_how_jax_finds_the_gpu(table, monkeypatch):
  """python -m sparsejax.info's line: listed, entered by the library, or neither; and a jax without the table."""
  _on_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", "9.0")
  assert pallas_triton_gpu.lookup() == "jax's table lists this GPU"
  _on_gpu(monkeypatch, RTX_4080, "8.9")
  assert pallas_triton_gpu.lookup().startswith("entered by sparsejax under its own capability")
  table.GpuInfo = _later_gpu_info
  _on_gpu(monkeypatch, "NVIDIA GeForce RTX 3090", "8.6")
  assert pallas_triton_gpu.lookup().endswith("could not enter it: XLA paths run")
  monkeypatch.setattr(pallas_triton_gpu, "_gpu_table", lambda: None)
  assert pallas_triton_gpu.lookup().startswith("from the device")


def test_lowering_for_a_kind_the_table_lacks_needs_its_capability(table):
  with pytest.raises(ValueError, match="does not know the GPU 'NVIDIA GeForce RTX 4080'; pass its compute_capab"):
    pallas_triton_gpu.lower_for_gpu(lambda x: x + 1, X, device_kind=RTX_4080)
  pallas_triton_gpu.lower_for_gpu(lambda x: x + 1, X, device_kind=RTX_4080, compute_capability="8.9")
  # entered under a name of the library's own (jax 0.11.2 refuses an abstract "NVIDIA ..." kind its table lacks)
  assert table.registry["sparsejax: " + RTX_4080]().compute_capability == 89


def _doubling(x):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  from jax.experimental.pallas import triton as plt
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,),
                        in_specs=[pl.BlockSpec(x.shape, lambda i: (0, 0))],
                        out_specs=pl.BlockSpec(x.shape, lambda i: (0, 0)),
                        compiler_params=plt.CompilerParams(num_warps=4))(x)


def test_a_triton_kernel_lowers_for_cuda_from_the_cpu():
  """As on an H100 by default: what the lowering checks of tests/ and experiments/ rely on. Arguments in a pytree,
  as arrays or shapes, lower alike, and the lowered module carries no sharding of the abstract device."""
  text = pallas_triton_gpu.lower_for_gpu(_doubling, X).as_text()
  assert text.count("xla.gpu.triton") == 1 and "sharding" not in text
  pair = lambda xs: _doubling(xs[0]) + xs[1]
  assert pallas_triton_gpu.lower_for_gpu(pair, [jnp.ones((16, 16)), X]).as_text().count("xla.gpu.triton") == 1


def _lowered_capabilities(monkeypatch) -> list:
  """The compute capability each Pallas Triton kernel is lowered for, as jax passes it to its Triton lowering. A
  kernel lowered before at the same shapes comes from jax's cache unseen: each test lowers shapes of its own."""
  from jax._src.pallas.triton import lowering

  seen, real = [], lowering.lower_jaxpr_to_triton_module

  def spy(jaxpr, grid_mapping, platform, compute_capability, *args, **kwargs):
    seen.append(compute_capability)
    return real(jaxpr, grid_mapping, platform, compute_capability, *args, **kwargs)

  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", spy)
  return seen


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the device in hand decides")
def test_off_the_gpu_a_kernel_is_lowered_for_the_h100_by_default(monkeypatch):
  seen = _lowered_capabilities(monkeypatch)
  pallas_triton_gpu.lower_for_gpu(_doubling, jax.ShapeDtypeStruct((16, 32), jnp.float32))
  assert seen == [90]


jax_table = pytest.mark.skipif(
    pallas_triton_gpu._gpu_table() is None,
    reason=f"jax {jax.__version__} reads the GPU from the device (the device-kind table came with jax 0.11)")


@jax_table
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the device in hand decides")
def test_on_jax_s_table_a_card_it_lacks_lowers_for_its_capability(monkeypatch):
  """jax 0.11 refuses to lower for an abstract RTX 4080 ("No supported GPU devices found"); given its
  capability, the kernel lowers for sm_89, and an A100, which the table has, for sm_80."""
  from jax._src.pallas.triton import gpu_info

  monkeypatch.setattr(gpu_info, "registry", dict(gpu_info.registry))  # the entry leaves with the test
  seen = _lowered_capabilities(monkeypatch)
  with pytest.raises(ValueError, match="does not know the GPU"):
    pallas_triton_gpu.lower_for_gpu(_doubling, X, device_kind=RTX_4080)
  pallas_triton_gpu.lower_for_gpu(_doubling, jax.ShapeDtypeStruct((16, 48), jnp.float32), device_kind=RTX_4080,
                                  compute_capability="8.9")
  pallas_triton_gpu.lower_for_gpu(_doubling, jax.ShapeDtypeStruct((16, 64), jnp.float32),
                                  device_kind="NVIDIA A100-SXM4-80GB")
  assert seen == [89, 80]


@jax_table
def test_on_jax_s_table_the_cards_it_knows_keep_their_entries():
  from jax._src.pallas.triton import gpu_info

  before = dict(gpu_info.registry)
  for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L4"):
    assert pallas_triton_gpu.knows_gpu(kind)
    pallas_triton_gpu.register_gpu(kind, "7.0")
  assert gpu_info.registry == before


@jax_table
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="runs a kernel on a GPU jax's table is made to lack")
def test_a_gpu_the_table_lacks_runs_the_library_s_triton_kernels(monkeypatch):
  """The card in hand, hidden from jax's table as an RTX 3090 or an L40S is: the library's kernels run for its own
  capability (jax 0.11.2 reads it from the device; earlier 0.11 releases read the entry shared_lowering makes)
  and match their reference."""
  from jax._src.pallas.triton import gpu_info
  from sparsejax.kernels.row_moves import gather_rows_reference, triton as row_moves

  monkeypatch.setattr(gpu_info, "registry", dict(gpu_info.registry))
  monkeypatch.setattr(gpu_info, "gpu_version_from_device_kind", lambda kind: None)
  clear = getattr(gpu_info.get_gpu_info, "cache_clear", lambda: None)
  clear()
  jax.clear_caches()  # the row gather compiled by another test in this process would not lower again
  seen = _lowered_capabilities(monkeypatch)
  try:
    src = jax.random.normal(jax.random.key(1), (40, 256), jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(2), (67,), 0, 41)  # 40: a zero row; 67 rows: shapes of its own
    out = row_moves.gather_rows(src, ids, interpret=False)
    assert jnp.array_equal(out, gather_rows_reference(src, ids))
    assert seen == [int(jax.devices()[0].compute_capability.replace(".", ""))]
    assert not pallas_triton_gpu.knows_gpu("no such card")
  finally:
    clear()
