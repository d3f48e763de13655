"""Every notebook in notebooks/ runs top to bottom without an error.

This is how CI executes the notebooks: each runs in a fresh Jupyter kernel of
this interpreter (the kernel must see the meshtrain under test), with
notebooks/ as its working directory. The notebooks assert their own results
against independent baselines, so a regression fails here.
"""

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT_S = 300


@pytest.fixture
def this_python_kernel(tmp_path, monkeypatch):
  """A `python3` kernelspec that starts `sys.executable`, first on the search
  path, so a user-wide `python3` kernel of another interpreter cannot win."""
  spec = tmp_path / "kernels" / "python3"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "Python 3 (meshtrain tests)",
      "language": "python",
  }))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
  return "python3"


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_runs(path, this_python_kernel):
  notebook = nbformat.read(path, as_version=4)
  # A last cell that reports the kernel's interpreter: it must be this one.
  notebook.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.prefix, end='')"))
  NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name=this_python_kernel,
                 resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
  assert notebook.cells[-1].outputs[0]["text"] == sys.prefix
