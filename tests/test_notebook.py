"""experiments/quickstart.ipynb executes top to bottom in a kernel of this interpreter."""
import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "experiments" / "quickstart.ipynb"


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


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
  pytest.importorskip("ipykernel")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(nb, kernel_name=_kernel_of_this_python(tmp_path, monkeypatch), timeout=300,
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  assert "validation bits per byte" in outputs
  assert f"sparsejax from {ROOT / 'sparsejax'}" in outputs
  images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
  assert len(images) == 2  # the loss curve and the expert load
