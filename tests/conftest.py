"""Test-wide setup: eight host devices so the expert-parallel tests can build meshes on the CPU, and a
quick XLA:CPU backend.

The tests compile far more than they compute (hundreds of small programs, each run a few times),
and most of a CPU compile is LLVM optimizing machine code: without its expensive passes a compile
takes about a third of the time. This changes how fast the compiled code runs, not what it computes
(XLA:CPU's fast math stays off), so no tolerance depends on it.
"""
import os

# Must be set before jax is imported anywhere in the test process (and in the processes it starts).
_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
          "--xla_llvm_disable_expensive_passes=true")
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_given] + [f for f in _FLAGS if f.split("=")[0] not in _given]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
