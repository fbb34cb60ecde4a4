"""Results a benchmark writes under its --out-dir also go to $OUT, the device machine's folder whose
files come back: copied once, and not onto themselves when --out-dir is $OUT (shutil.copy raises
SameFileError there, which ended a decode bench with a traceback after its results were written)."""
from __future__ import annotations

import os
import shutil


def copy_to_out(*paths) -> None:
  """Copy each existing path into $OUT, if $OUT is set and is not the folder the path is in."""
  out = os.environ.get("OUT")
  if not out:
    return
  for path in map(os.fspath, paths):
    if os.path.exists(path) and os.path.realpath(os.path.dirname(path) or ".") != os.path.realpath(out):
      shutil.copy(path, out)
