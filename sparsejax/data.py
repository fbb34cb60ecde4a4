"""Byte-level data: corpora as 1-D token arrays, and deterministic, resumable batch streams.

Tokens are bytes (vocabulary 256), so no tokenizer or download is needed. Sources:
  * None / "stdlib": the running Python's standard-library sources (found through sysconfig),
    split into train and validation by file;
  * "site-packages": the .py files of the running Python's installed packages, split the same way:
    hundreds of MB where a framework such as torch is installed, for runs long enough to pass
    many times over the standard library;
  * a folder of text files (split by file) or one text file (split by position);
  * a nanoGPT-layout uint16 ``.bin`` (``train.bin`` uses a sibling ``val.bin`` when there is one).
"""
from __future__ import annotations

import codecs
import dataclasses
import pathlib
import sysconfig
import zlib

import numpy as np
from jaxtyping import Int

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".c", ".h", ".json", ".html", ".tex", ".csv", "")


@dataclasses.dataclass(frozen=True)
class Corpus:
  """train and val are 1-D token arrays (uint8 for bytes, uint16 for .bin files, possibly memory-mapped)."""
  name: str
  train: np.ndarray
  val: np.ndarray
  vocab_size: int
  byte_level: bool


def looks_binary(head: bytes) -> bool:
  """Whether bytes (a file's first few KiB) are not text: a NUL byte, or, unless they decode as
  UTF-8, more than 30% control or high bytes (the heuristic of Perl's -B and of git)."""
  if b"\0" in head:
    return True
  try:
    codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a cut multi-byte char is fine
    return False
  except UnicodeDecodeError:
    pass
  odd = sum(1 for b in head if (b < 32 and b not in b"\t\n\r\f\b\x1b") or b > 127)
  return odd > 0.3 * len(head)


def _check_text(path: pathlib.Path, allow_binary: bool) -> None:
  if allow_binary:
    return
  with open(path, "rb") as f:
    if looks_binary(f.read(8192)):
      raise ValueError(f"Data file {str(path)!r} looks binary, not text; pass --allow-binary "
                       f"(allow_binary=True) to train on its bytes anyway, or a uint16 .bin of token ids.")


def _is_val_file(rel: str, val_fraction: float) -> bool:
  # A hash of the relative path, not a random draw: the split is the same on every run and machine.
  return zlib.crc32(rel.encode()) % 10_000 < val_fraction * 10_000


def _split_files(files: list[pathlib.Path], root: pathlib.Path, name: str, val_fraction: float) -> Corpus:
  train, val = [], []
  for f in sorted(files):
    (val if _is_val_file(f.relative_to(root).as_posix(), val_fraction) else train).append(f.read_bytes())
  if not val or not train:  # too few files for a hash split: hold out the last one
    both = train + val
    if len(both) < 2:
      return _split_bytes(b"".join(both), name, val_fraction)
    train, val = both[:-1], both[-1:]
  as_tokens = lambda parts: np.frombuffer(b"\n".join(parts), dtype=np.uint8)
  return Corpus(name, as_tokens(train), as_tokens(val), 256, True)


def _split_bytes(data: bytes, name: str, val_fraction: float) -> Corpus:
  tokens = np.frombuffer(data, dtype=np.uint8)
  n_val = max(1, int(len(tokens) * val_fraction))
  return Corpus(name, tokens[:-n_val], tokens[-n_val:], 256, True)


def stdlib_files() -> tuple[pathlib.Path, list[pathlib.Path]]:
  """The .py files of this interpreter's standard library, without installed packages."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = [f for f in root.rglob("*.py")
           if not {"site-packages", "dist-packages", "__pycache__"} & set(f.parts)]
  return root, files


def site_packages_files() -> tuple[pathlib.Path, list[pathlib.Path]]:
  """The .py files of this interpreter's installed packages (sysconfig's purelib)."""
  root = pathlib.Path(sysconfig.get_paths()["purelib"])
  return root, [f for f in root.rglob("*.py") if "__pycache__" not in f.parts]


BUILT_IN = {  # name: (what it holds, its files)
    "stdlib": ("standard-library", stdlib_files),
    "site-packages": ("installed-package", site_packages_files),
}


def _load_bin(path: pathlib.Path, val_fraction: float, vocab_size: int | None) -> Corpus:
  if path.stat().st_size % 2:
    raise ValueError(f"{str(path)!r} has an odd number of bytes: a .bin file holds uint16 token ids.")
  tokens = np.memmap(path, dtype=np.uint16, mode="r")
  val_path = path.with_name("val.bin")
  if path.name == "train.bin" and val_path.exists():
    train, val = tokens, np.memmap(val_path, dtype=np.uint16, mode="r")
  else:
    n_val = max(1, int(len(tokens) * val_fraction))
    train, val = tokens[:-n_val], tokens[-n_val:]
  top = int(max(train.max(initial=0), val.max(initial=0))) + 1
  if vocab_size is None:
    vocab_size = 256 if top <= 256 else -(-top // 64) * 64  # round up: friendlier matmul shapes
  elif top > vocab_size:  # an id past the embedding gathers garbage, and training goes to NaN
    raise ValueError(f"{str(path)!r} holds token id {top - 1}, not below vocab_size={vocab_size}: pass a "
                     f"vocab_size of at least {top}, or none to size it from the data.")
  return Corpus(str(path), train, val, vocab_size, vocab_size == 256)


def load_corpus(source: str | None = None, *, val_fraction: float = 0.1,
                vocab_size: int | None = None, allow_binary: bool = False) -> Corpus:
  """Load a corpus (see the module docstring for the sources). Missing, empty and (unless
  allow_binary) binary text data fail with a one-line error naming the path.

  vocab_size: None sizes it from the data (256 for text); a given one is the corpus's, and must lie
  above every token id (at least 256 for text): a smaller one is an error.
  """
  corpus = _load_corpus(source, val_fraction, vocab_size, allow_binary)
  if vocab_size is None or vocab_size == corpus.vocab_size:  # a .bin corpus took vocab_size already
    return corpus
  if vocab_size < corpus.vocab_size:
    raise ValueError(f"vocab_size={vocab_size} is smaller than the byte-level corpus {corpus.name!r} needs: "
                     f"its tokens are bytes, 0 to 255; pass a vocab_size of at least 256, or none.")
  return dataclasses.replace(corpus, vocab_size=vocab_size)


def _load_corpus(source: str | None, val_fraction: float, vocab_size: int | None, allow_binary: bool) -> Corpus:
  source = source or "stdlib"
  if source in BUILT_IN:
    what, find_files = BUILT_IN[source]
    root, files = find_files()
    if not files:
      raise FileNotFoundError(f"No {what} sources found under {root}; pass a data path.")
    return _split_files(files, root, source, val_fraction)
  path = pathlib.Path(source).expanduser()
  if not path.exists():
    raise FileNotFoundError(f"Data path {str(path)!r} does not exist: pass a text file, a folder of "
                            f"text files, a uint16 .bin file, or 'stdlib' / 'site-packages' for a built-in corpus.")
  if path.is_dir():
    files = [f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES
             and not any(p.startswith(".") for p in f.relative_to(path).parts)]
    if not files:
      raise FileNotFoundError(f"Folder {str(path)!r} holds no text files ({', '.join(TEXT_SUFFIXES[:-1])}).")
    if all(f.stat().st_size == 0 for f in files):
      raise ValueError(f"Data folder {str(path)!r} holds only empty files.")
    for f in files:
      _check_text(f, allow_binary)
    return _split_files(files, path, str(path), val_fraction)
  if path.stat().st_size == 0:
    raise ValueError(f"Data file {str(path)!r} is empty.")
  if path.suffix == ".bin":
    return _load_bin(path, val_fraction, vocab_size)
  _check_text(path, allow_binary)
  return _split_bytes(path.read_bytes(), str(path), val_fraction)


def process_rows(batch_size: int, process_index: int, process_count: int) -> slice:
  """The rows of a global batch that process_index of process_count reads: an equal contiguous block."""
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must lie in [0, process_count={process_count}).")
  if batch_size % process_count:
    raise ValueError(f"batch size {batch_size} does not split over {process_count} processes.")
  per = batch_size // process_count
  return slice(process_index * per, (process_index + 1) * per)


class BatchStream:
  """Random windows of seq_len + 1 tokens: batch n is a pure function of (seed, n), so state is two ints.

  inputs = window[:-1], targets = window[1:]. state() / BatchStream(..., position=p) resume exactly.
  Of several processes, process i of count reads only rows [i * b / count, (i + 1) * b / count) of
  the global batch of b = batch_size rows, the same rows one process would read there.
  """

  def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, *, seed: int = 0, position: int = 0,
               process_index: int = 0, process_count: int = 1):
    if len(tokens) < seq_len + 2:
      raise ValueError(f"Corpus of {len(tokens)} tokens is too short for seq_len={seq_len}.")
    self.rows = process_rows(batch_size, process_index, process_count)
    self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
    self.seed, self.position = seed, position

  def batch(self, n: int) -> tuple[Int[np.ndarray, "b t"], Int[np.ndarray, "b t"]]:
    rng = np.random.default_rng([self.seed, n])
    starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)[self.rows]
    windows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1]) for s in starts]).astype(np.int32)
    return windows[:, :-1], windows[:, 1:]

  def __iter__(self):
    return self

  def __next__(self):
    out = self.batch(self.position)
    self.position += 1
    return out

  def state(self) -> dict:
    return {"seed": int(self.seed), "position": int(self.position)}

  def restore(self, state: dict) -> None:
    self.seed, self.position = int(state["seed"]), int(state["position"])


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, num_batches: int, *,
                 process_index: int = 0, process_count: int = 1):
  """Fixed validation batches: evenly spaced windows, the same every call, independent of any seed
  (each process's rows of them, as BatchStream's)."""
  rows = process_rows(batch_size, process_index, process_count)
  n = num_batches * batch_size
  span = len(tokens) - seq_len - 1
  if span < 1:
    raise ValueError(f"Validation split of {len(tokens)} tokens is too short for seq_len={seq_len}.")
  starts = np.linspace(0, span - 1, n).astype(np.int64).reshape(num_batches, batch_size)[:, rows].ravel()
  windows = np.stack([np.asarray(tokens[s:s + seq_len + 1]) for s in starts]).astype(np.int32)
  windows = windows.reshape(num_batches, -1, seq_len + 1)
  return [(w[:, :-1], w[:, 1:]) for w in windows]
