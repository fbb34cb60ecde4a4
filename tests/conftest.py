"""Test-wide setup: eight host devices so the expert-parallel tests can build meshes on the CPU."""
import os

# Must be set before jax is imported anywhere in the test process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
