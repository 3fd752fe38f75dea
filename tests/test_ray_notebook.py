"""The Ray Tune quickstart notebook runs end to end on the CPU (bundled tiny model, local Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ray")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "ray_tune_quickstart.ipynb"


@pytest.mark.slow
def test_ray_tune_quickstart_notebook_runs(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})  # runs in tmp_path
    client.execute()

    outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for o in cell.get("outputs", []))
    assert "12 trials, 0 errors" in outputs
    assert "base model loads: [1]" in outputs
    assert "best: eval loss" in outputs
