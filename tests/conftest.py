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
import os

# Must be set before jax is imported anywhere in the test process (and in the processes it starts).
_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
          "--xla_llvm_disable_expensive_passes=true")
# Only where the tests run on the CPU alone: a GPU run (JAX_PLATFORMS=cuda) compiles little on the
# CPU, and its newer jaxlib need not know these XLA:CPU flags (XLA stops on an unknown flag).
if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
  _FLAGS += ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_given] + [f for f in _FLAGS if f.split("=")[0] not in _given]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
