"""tests_gpu/ runs the kernels compiled, so it needs a GPU: off one, the run stops before collecting, in
one line, instead of failing every test (tests that need more than one GPU skip themselves)."""
import jax
import pytest


def pytest_sessionstart(session):
  if jax.default_backend() != "gpu":
    pytest.exit("tests_gpu/ needs a GPU", returncode=1)
