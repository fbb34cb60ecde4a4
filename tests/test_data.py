"""Corpora and batch streams: sources, deterministic split, determinism, resume, clear errors."""
import numpy as np
import pytest

from sparsejax.data import BatchStream, eval_batches, load_corpus, looks_binary


def test_stdlib_corpus_split_by_file_is_deterministic():
  a, b = load_corpus(), load_corpus()
  assert a.vocab_size == 256 and a.byte_level
  assert len(a.train) > 1_000_000 and len(a.val) > 10_000
  assert len(a.train) == len(b.train) and np.array_equal(a.val[:1000], b.val[:1000])


def test_site_packages_corpus(tmp_path, monkeypatch):
  """'site-packages': the installed packages' .py files (compiled caches and other files left out)."""
  import sysconfig
  paths = sysconfig.get_paths()
  monkeypatch.setattr(sysconfig, "get_paths", lambda: {**paths, "purelib": str(tmp_path)})
  with pytest.raises(FileNotFoundError, match="No installed-package sources"):
    load_corpus("site-packages")
  for i in range(40):
    pkg = tmp_path / f"pkg{i}"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"X = {i}\n" * 20)
    (pkg / "__pycache__" / "cached.py").write_text("left out")
    (pkg / "data.txt").write_text("left out")
  c = load_corpus("site-packages")
  assert c.name == "site-packages" and c.byte_level
  text = bytes(c.train) + bytes(c.val)
  assert len(c.train) > len(c.val) > 0 and b"left out" not in text
  # Each split joins its files with newlines: 40 files, 38 separators.
  assert len(text) == sum(len(f"X = {i}\n" * 20) for i in range(40)) + 38


def test_folder_text_file_and_bin(tmp_path):
  for i in range(30):
    (tmp_path / f"f{i}.txt").write_text(f"file {i} " * 50)
  c = load_corpus(str(tmp_path))
  assert len(c.train) > len(c.val) > 0
  one = load_corpus(str(tmp_path / "f0.txt"))
  assert len(one.train) + len(one.val) == len("file 0 " * 50)
  tokens = (np.arange(5000) % 300).astype(np.uint16)
  tokens.tofile(tmp_path / "train.bin")
  tokens[:500].tofile(tmp_path / "val.bin")
  b = load_corpus(str(tmp_path / "train.bin"))
  assert len(b.train) == 5000 and len(b.val) == 500 and b.vocab_size == 320 and not b.byte_level


def test_a_given_vocab_size_must_cover_the_data(tmp_path):
  """Ids >= vocab_size would index past the embedding (training goes to NaN); text needs all 256 bytes."""
  (np.arange(5000) % 300).astype(np.uint16).tofile(tmp_path / "tok.bin")
  with pytest.raises(ValueError, match="token id 299, not below vocab_size=100: pass a vocab_size of at least 300"):
    load_corpus(str(tmp_path / "tok.bin"), vocab_size=100)
  assert load_corpus(str(tmp_path / "tok.bin"), vocab_size=300).vocab_size == 300
  (tmp_path / "a.txt").write_text("text " * 100)
  with pytest.raises(ValueError, match="vocab_size=10 is smaller than the byte-level corpus"):
    load_corpus(str(tmp_path / "a.txt"), vocab_size=10)
  wide = load_corpus(str(tmp_path / "a.txt"), vocab_size=512)
  assert wide.vocab_size == 512 and wide.byte_level


def test_missing_path_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_corpus(str(tmp_path / "nope.txt"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no text files"):
    load_corpus(str(tmp_path / "empty"))


def test_binary_and_empty_data(tmp_path):
  assert looks_binary(b"text\0more") and looks_binary(bytes(range(128, 256)) * 4)
  assert not looks_binary("UTF-8: déjà vu, 専門家".encode())
  assert not looks_binary("専門家".encode()[:-1])  # a multi-byte character cut by the 8 KiB window
  assert not looks_binary("Latin-1: déjà vu, naïve café".encode("latin-1"))
  assert not looks_binary(b"")
  (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02" * 100)
  with pytest.raises(ValueError, match="looks binary"):
    load_corpus(str(tmp_path / "blob.txt"))
  assert len(load_corpus(str(tmp_path / "blob.txt"), allow_binary=True).train) == 270
  (tmp_path / "empty.txt").write_bytes(b"")
  with pytest.raises(ValueError, match="is empty"):
    load_corpus(str(tmp_path / "empty.txt"))
  (tmp_path / "empties").mkdir()
  (tmp_path / "empties" / "a.txt").write_bytes(b"")
  with pytest.raises(ValueError, match="only empty files"):
    load_corpus(str(tmp_path / "empties"))


def test_stream_is_deterministic_and_resumes():
  tokens = np.random.default_rng(0).integers(0, 256, 10_000).astype(np.uint8)
  s = BatchStream(tokens, 4, 32, seed=7)
  batches = [next(s) for _ in range(6)]
  x, y = batches[0]
  assert x.shape == y.shape == (4, 32) and x.dtype == np.int32
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
  again = BatchStream(tokens, 4, 32, seed=7)
  assert all(np.array_equal(next(again)[0], b[0]) for b in batches)
  resumed = BatchStream(tokens, 4, 32, seed=0)
  resumed.restore({"seed": 7, "position": 3})
  assert all(np.array_equal(next(resumed)[0], b[0]) for b in batches[3:])
  assert s.state() == {"seed": 7, "position": 6}
  assert not np.array_equal(next(BatchStream(tokens, 4, 32, seed=8))[0], batches[0][0])


def test_eval_batches_are_fixed():
  tokens = np.arange(1000, dtype=np.uint16)
  a, b = eval_batches(tokens, 2, 16, 3), eval_batches(tokens, 2, 16, 3)
  assert len(a) == 3 and all(np.array_equal(p[0], q[0]) for p, q in zip(a, b))
