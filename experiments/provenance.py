"""Which sparsejax a benchmark ran: a fingerprint of its source, printed in each benchmark's header.

An A/B compares two trees, and the benchmarks put their own repository root first on sys.path, so a
PYTHONPATH naming another tree is ignored without a word: on 2026-11-26 two decode A/Bs ran one tree
twice (experiments/notes_decode.md). The two sides of a real A/B print different fingerprints.
"""
from __future__ import annotations

import hashlib
import pathlib


def source_fingerprint(root: str | pathlib.Path | None = None) -> str:
  """12 hex digits of sha256 over the package's .py files (relative path and bytes, in sorted order);
  root defaults to the directory of the sparsejax that Python imports."""
  if root is None:
    import sparsejax
    root = pathlib.Path(sparsejax.__file__).parent
  root = pathlib.Path(root)
  h = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
  return h.hexdigest()[:12]
