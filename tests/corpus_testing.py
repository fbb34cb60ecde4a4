"""A small text corpus for training tests, the same in every test that writes one."""
import numpy as np

WORDS = ["alpha", "beta", "gamma", "delta", "moe", "expert", "router", "token"]


def write_corpus(tmp_path, docs: int = 4, words_per_doc: int = 300) -> str:
  """docs files of random words under tmp_path/corpus (seeded, so every call writes the same text)."""
  d = tmp_path / "corpus"
  d.mkdir(exist_ok=True)
  rng = np.random.default_rng(0)
  for i in range(docs):
    (d / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS, words_per_doc)))
  return str(d)
