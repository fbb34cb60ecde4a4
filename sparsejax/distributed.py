"""Several processes (hosts, or one process per GPU) on JAX's own runtime: `jax.distributed`.

`initialize_from_env()` starts it when the environment says the job has several processes:
  * JAX_NUM_PROCESSES > 1 (plain launches, e.g. one `ssh` per host): also JAX_PROCESS_ID (0 .. n-1)
    and JAX_COORDINATOR_ADDRESS (host:port of process 0, reachable from every host). jax itself
    reads only JAX_COORDINATOR_ADDRESS (and JAX_LOCAL_DEVICE_IDS); the process count and id are
    passed on from here.
  * inside `srun` with SLURM_NTASKS > 1: `jax.distributed.initialize()` without arguments, which
    finds the coordinator, count and id in SLURM's variables (JAX_COORDINATOR_PORT picks the port).
On the CPU the processes' collectives go through gloo (jax_cpu_collectives_implementation).
Must run before anything asks jax for its devices.
"""
from __future__ import annotations

import os
from typing import Mapping

import jax


def _int(environ: Mapping[str, str], name: str, low: int) -> int:
  value = environ.get(name, "")
  if not value.strip().isdigit() or int(value) < low:
    raise ValueError(f"{name}={value!r}: expected an integer >= {low}.")
  return int(value)


def initialize_from_env(environ: Mapping[str, str] | None = None) -> bool:
  """jax.distributed.initialize(...) when environ (default os.environ) describes a multi-process job;
  returns whether it did. A single process, or a runtime already started, is left as it is."""
  environ = os.environ if environ is None else environ
  if jax.distributed.is_initialized():
    return False
  if "JAX_NUM_PROCESSES" in environ:
    count = _int(environ, "JAX_NUM_PROCESSES", 1)
    if count == 1:
      return False
    pid = _int(environ, "JAX_PROCESS_ID", 0)
    if pid >= count:
      raise ValueError(f"JAX_PROCESS_ID={pid} must be below JAX_NUM_PROCESSES={count}.")
    address = environ.get("JAX_COORDINATOR_ADDRESS", "")
    if ":" not in address:
      raise ValueError(f"JAX_COORDINATOR_ADDRESS={address!r}: expected host:port of process 0 "
                       f"(needed with JAX_NUM_PROCESSES={count}).")
    _set_cpu_collectives()
    jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=pid)
    return True
  if "SLURM_JOB_ID" in environ and "SLURM_STEP_NODELIST" in environ and environ.get("SLURM_NTASKS", "1") != "1":
    _set_cpu_collectives()
    jax.distributed.initialize()
    return True
  return False


def _set_cpu_collectives() -> None:
  # Without an implementation XLA:CPU cannot run a computation that spans processes; "gloo" is
  # jax's default on recent versions, set here for the versions where it is not.
  if getattr(jax.config, "jax_cpu_collectives_implementation", None) in (None, "none"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def is_main_process() -> bool:
  """Process 0 writes the logs, metrics and progress bar; orbax coordinates checkpoint writes itself."""
  return jax.process_index() == 0
