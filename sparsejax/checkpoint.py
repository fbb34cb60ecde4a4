"""Checkpoints through orbax: a pytree of arrays (params, optimizer state) plus a small JSON record.

Orbax writes each step to a temporary directory and renames (or marks) it only after the write
completes, so a checkpoint from a crashed write is never listed and never restored.
"""
from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(OSError):
  """A finished checkpoint that cannot be read (files deleted, truncated or corrupted after it was written)."""


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                      tree)


class Checkpointer:
  """save(step, items, meta) every `every` steps (or with force=True), keeping the last `keep`."""

  def __init__(self, directory: str | pathlib.Path, *, every: int = 1000, keep: int = 3):
    self.directory = pathlib.Path(directory).absolute()
    self.every = max(1, every)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True,
        # Synchronous: the train step donates its buffers, and saves are rare enough not to matter.
        enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step: int, items: dict[str, Any], meta: dict, *, force: bool = False) -> bool:
    """items: named pytrees of arrays (e.g. params, opt_state), each restorable on its own."""
    if (not force and step % self.every) or step in self.manager.all_steps():
      return False
    args = ocp.args.Composite(meta=ocp.args.JsonSave(meta),
                              **{k: ocp.args.StandardSave(v) for k, v in items.items()})
    # The decision is ours (above): orbax's default policy would also save the first step of a run.
    saved = self.manager.save(step, args=args, force=True)
    self.manager.wait_until_finished()
    return bool(saved)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def restore(self, targets: dict[str, Any], step: int | None = None) -> tuple[dict[str, Any], dict]:
    """(items, meta) of `step` (default latest); targets name the items wanted, as pytrees of arrays or
    ShapeDtypeStructs giving structure, shapes, dtypes (and shardings) to restore into."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No finished checkpoint under {self.directory}.")
    args = ocp.args.Composite(meta=ocp.args.JsonRestore(),
                              **{k: ocp.args.StandardRestore(_abstract(v)) for k, v in targets.items()})
    out = self._restore(step, args)
    return {k: out[k] for k in targets}, out["meta"]

  def restore_meta(self, step: int | None = None) -> dict:
    """Only the JSON record (e.g. the model config, to build the target before restoring arrays)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No finished checkpoint under {self.directory}.")
    return self._restore(step, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def _restore(self, step: int, args):
    try:
      out = self.manager.restore(step, args=args)
      if "meta" in args.keys() and not isinstance(out["meta"], dict):
        raise ValueError("its meta record is not a JSON object")
      return out
    except Exception as e:  # orbax and tensorstore raise many kinds, some hundreds of lines long
      earlier = [s for s in self.all_steps() if s < step]
      fall_back = (f"delete {str(self.directory / str(step))!r} to resume from step {max(earlier)}" if earlier
                   else f"delete {str(self.directory / str(step))!r}")
      cause = " ".join(str(e).split()).split(" See full")[0][:200]
      self.close()  # its background work would otherwise fail noisily at exit, after this one line
      raise CheckpointError(f"checkpoint step {step} in {str(self.directory)!r} cannot be read "
                            f"({type(e).__name__}: {cause}): {fall_back}.") from e

  def close(self) -> None:
    self.manager.close()
