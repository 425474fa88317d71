"""The quickstart notebook, executed as a reader would run it (nbclient); its `assert`s are the checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ravnest_p2p

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

# in the default suite (issue 14: `make test` executes the quickstart): about 50-90 s on a lightly loaded
# 2-core host, 234 s at load 20
pytestmark = [pytest.mark.timeout(900)]

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def test_quickstart_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = str(Path(ravnest_p2p.__file__).resolve().parents[1])  # this checkout, for kernel and peers
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, with the failing cell, if an assert fails
    assert (tmp_path / "quickstart_progress.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "quickstart_timeline.png").read_bytes().startswith(b"\x89PNG")
    outputs = [out for cell in notebook.cells for out in cell.get("outputs", [])]
    assert any("image/png" in out.get("data", {}) for out in outputs)
    text = "".join(out.get("text", "") for out in outputs)
    assert "3 peers" in text
    assert "cluster 0:" in text
