"""experiments/quickstart.ipynb executes top to bottom in a kernel of this interpreter, and is saved clean."""
import json
import re
import sys
from pathlib import Path

import pytest

# The test extra installs nbformat and nbclient (CI always has them); a machine set up without the extra, such as
# the GPU image, skips this file saying so instead of failing the whole run's collection.
nbformat = pytest.importorskip("nbformat", reason="the notebook test needs the test extra (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "experiments" / "quickstart.ipynb"
# The notebook's own 150 steps show learning; the test checks every cell runs. 6 steps: past its
# log_every of 5 (the plots need a logged train row) and three evaluations (eval_every = steps // 3).
TEST_STEPS = 6


def _kernel_of_this_python(tmp_path, monkeypatch) -> str:
  """A kernelspec that runs this very interpreter, whatever kernels the machine has registered."""
  name = "sparsejax-test"
  spec_dir = tmp_path / "jupyter" / "kernels" / name
  spec_dir.mkdir(parents=True)
  spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
          "display_name": "sparsejax test", "language": "python"}
  (spec_dir / "kernel.json").write_text(json.dumps(spec))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  # The kernel imports this checkout's sparsejax, not another installed copy.
  monkeypatch.setenv("PYTHONPATH", str(ROOT))
  return name


def test_saved_notebook_is_clean():
  """No outputs, execution counts or machine paths are committed, and the steps cell is tagged."""
  text = NOTEBOOK.read_text()
  assert not re.search(r"/(work|tmp|root|home|Users)/", text)
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.outputs == [] and c.execution_count is None for c in code)
  params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1 and params[0].source.startswith("steps = ")


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
  pytest.importorskip("ipykernel")
  from nbclient import NotebookClient
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # As papermill does: a cell after the one tagged "parameters" sets the test's value.
  at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  nb.cells.insert(at + 1, nbformat.v4.new_code_cell(f"steps = {TEST_STEPS}"))
  client = NotebookClient(nb, kernel_name=_kernel_of_this_python(tmp_path, monkeypatch), timeout=300,
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  stdout = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
  stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
  assert stderr == ""  # no warnings
  assert f"done: step {TEST_STEPS}," in stdout and "validation bits per byte" in stdout
  assert f"sparsejax from {ROOT / 'sparsejax'}" in stdout
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) == 2  # the loss curve and the expert load
