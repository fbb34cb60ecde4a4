"""The README stays true to the tree: every file it cites exists, and CI runs its test command."""
import glob
import itertools
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()

# Backticked tokens that name a file or folder of the repository: a path from the root, or a results
# file by name (the README cites those as results/NAME or NAME alone, under experiments/results).
_PREFIXES = ("experiments/", "sparsejax/", "tests/", "tests_gpu/", "results/")
_RESULT_NAME = re.compile(r"(H100|H200|h100|h200)")


def _expand_braces(pattern: str) -> list[str]:
  """'a{b,c}d{,e}' -> ['abd', 'abde', 'acd', 'acde'], as a shell expands it (no nesting)."""
  parts = re.split(r"(\{[^{}]*\})", pattern)
  choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
  return ["".join(c) for c in itertools.product(*choices)]


def _cited_paths() -> list[str]:
  paths = []
  for token in re.findall(r"`([^`\s]+)`", README):
    token = token.rstrip(".,;:")
    if token.startswith(_PREFIXES) or (_RESULT_NAME.search(token) and "." in token and "/" not in token):
      paths.append(token)
  return sorted(set(paths))


def _resolve(token: str) -> str:
  if token.startswith("results/"):
    return "experiments/" + token
  if token.startswith(_PREFIXES):
    return token
  return "experiments/results/" + token


def test_the_readme_cites_results_files():
  cited = _cited_paths()
  assert len([p for p in cited if "results" in _resolve(p)]) > 40, "the README's citations were not found"


def test_every_path_the_readme_cites_exists():
  missing = []
  for token in _cited_paths():
    found = any(glob.glob(os.path.join(ROOT, p)) for p in _expand_braces(_resolve(token)))
    if not found:
      missing.append(token)
  assert not missing, f"the README cites paths that are not in the tree: {missing}"


def test_brace_expansion_covers_empty_and_several_choices():
  assert _expand_braces("a{,_b}.{md,json}") == ["a.md", "a.json", "a_b.md", "a_b.json"]


def test_ci_runs_the_readmes_test_command():
  ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
  readme_command = re.search(r'pip install -e "\.\[test\]" && \.venv/bin/(python -m pytest [^\n`]*)', README)
  assert readme_command, "the README's test command was not found"
  assert readme_command.group(1).strip() in ci, (readme_command.group(1), ci)
