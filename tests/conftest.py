"""Test-wide setup: eight host devices so the expert-parallel tests can build meshes on the CPU, and a
quick XLA:CPU backend.

The tests compile far more than they compute (hundreds of small programs, each run a few times),
and most of a CPU compile is LLVM optimizing machine code: without its expensive passes a compile
takes about a third of the time. XLA:CPU's older fusion emitters (LLVM IR straight from HLO, not
the MLIR fusion pipeline) and one codegen module instead of parallel splits (two busy test workers
leave no core for them) halve that again; backend compiles had been 60% of the suite's time. This
changes how fast the compiled code runs, not what it computes (XLA:CPU's fast math stays off): the
one difference a probe of the usual ops found is float32 tanh (and so exact GELU), within 4e-7
relative of the other emitters' (a few ulp), far inside every tolerance here.
"""
import gc
import os

import pytest


def _jaxlib_version() -> tuple[int, ...]:
  from importlib import metadata
  try:
    return tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2])
  except (metadata.PackageNotFoundError, ValueError):
    return (0, 0)


# Must be set before jax is imported anywhere in the test process (and in the processes it starts).
_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
          "--xla_llvm_disable_expensive_passes=true")
# Only where the tests run on the CPU alone: a GPU run (JAX_PLATFORMS=cuda) compiles little on the
# CPU. XLA stops on an unknown flag, and jaxlib 0.11 no longer knows the emitters' one (measured on
# 0.11.2), so that flag goes to older jaxlibs only.
if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
  _FLAGS += ("--xla_cpu_parallel_codegen_split_count=1",)
  if _jaxlib_version() < (0, 11):
    _FLAGS += ("--xla_cpu_use_fusion_emitters=false",)
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_given] + [f for f in _FLAGS if f.split("=")[0] not in _given]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Under pytest-xdist (`-n N`), each worker gets its own share of the CPUs this run may use (one core
# each for `-n 2` on two cores), and the processes a test starts inherit it. Unpinned, every worker's
# XLA:CPU sizes its thread pools for all the machine's cores, so the workers' threads contend for the
# same cores and preempt one another: about 40 s of the suite's 5 to 6 minutes on two cores. Pinned
# before jax starts (this file is imported before any test module), a worker's pools fit its share.
# Where the run is not split (no xdist, or one worker), nothing changes. This moves where the
# computations run, not what they compute.
_worker, _workers = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _worker.startswith("gw") and _workers > 1 and hasattr(os, "sched_setaffinity"):
  # a worker that replaces a crashed one counts on (gw8 for -n 8), so its index wraps onto a share
  _cpus, _i = sorted(os.sched_getaffinity(0)), int(_worker[2:]) % _workers
  _n = len(_cpus)
  _share = _cpus[_i * _n // _workers:(_i + 1) * _n // _workers] if _workers <= _n else [_cpus[_i % _n]]
  os.sched_setaffinity(0, _share)

# The cyclic garbage collector's full passes scan every object the worker holds, and a worker holds
# ever more (modules, jaxprs, compiled programs in the tests' caches): at the default thresholds
# they cost each worker about 15 s of a run. Tracing allocates in bursts, so collect less often.
# Only when unreachable cycles are freed changes; whatever is freed by reference counting (most
# arrays) still goes at once.
gc.set_threshold(20000, 20, 20)


# The suite is written for the CPU (eight host devices, interpret mode), and CI runs it there, where none of the markers
# below ever skips. Run on a GPU (JAX_PLATFORMS=cuda, which also compiles the kernels' tests), the tests that cannot
# hold there say why in one line instead of failing: a skip names what the test needs, so every failure left is news.
def pytest_configure(config):
  config.addinivalue_line("markers", "devices(n): needs n devices of the backend under test (the CPU suite has 8)")
  config.addinivalue_line("markers", "cpu_suite(reason): holds only on the CPU backend, for the reason given")
  config.addinivalue_line("markers", "host_callbacks: runs kernels in Pallas' interpret mode, which needs a CPU device")


def pytest_runtest_setup(item):
  import jax

  for mark in item.iter_markers("devices"):
    if jax.device_count() < mark.args[0]:
      pytest.skip(f"needs {mark.args[0]} devices; {jax.default_backend()} has {jax.device_count()} here "
                  "(the CPU suite runs 8 host devices)")
  for mark in item.iter_markers("cpu_suite"):
    if jax.default_backend() != "cpu":
      pytest.skip(f"written for the CPU backend: {mark.args[0]}")
  if item.get_closest_marker("host_callbacks") and not _has_cpu_device():
    # interpret mode runs each kernel through io_callback on a CPU device; JAX_PLATFORMS=cuda starts none
    pytest.skip("runs kernels in Pallas' interpret mode, whose callbacks need a CPU device "
                "(JAX_PLATFORMS=cuda,cpu runs it on a GPU machine)")


def _has_cpu_device() -> bool:
  import jax

  try:
    return bool(jax.devices("cpu"))
  except RuntimeError:
    return False


@pytest.fixture(autouse=True)
def _no_results_copy(monkeypatch):
  # The experiment scripts copy their results to $OUT when it is set (the device machine hands back what lies
  # there). A test writes under its tmp_path, so a shell's $OUT must not collect copies of its outputs; a test
  # that checks the copy sets OUT itself.
  monkeypatch.delenv("OUT", raising=False)
