"""The getting-started notebook runs top to bottom on the CPU."""

import os
import pathlib

import nbclient
import nbformat

from conftest import BACKEND

_NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "recipes" / "getting_started.ipynb"


def test_getting_started_notebook_runs(tmp_path, monkeypatch):
    notebook = nbformat.read(_NOTEBOOK, as_version=4)
    # The kernel is a child process: it gets the backend and this checkout.
    monkeypatch.setenv("KERAS_BACKEND", BACKEND)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(_NOTEBOOK.parents[1]), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code"
               for o in cell.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    assert "The smallest feasible budget is" in text
    assert "Memory: budget" in text and "AutoVM epoch 2/2" in text
    # Both figures shown inline.
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2
