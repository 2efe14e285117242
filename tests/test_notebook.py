"""The tutorial notebook runs top to bottom, so it never rots."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "tutorial.ipynb"


@pytest.mark.timeout(400)
def test_the_tutorial_runs_top_to_bottom(tmp_path: Path) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, with the cell, if any cell fails
    text = "\n".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )
    assert "verdict                loader-bound (latency)" in text
    assert "autoloader report" in text and "with the defaults" in text
    assert (tmp_path / "best.json").exists() and (tmp_path / "tuning.png").exists()
    assert "loop speed:" in text
