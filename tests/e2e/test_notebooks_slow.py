"""Notebooks 2 and 3, executed as a reader would run them (nbclient); their `assert`s are the checks.

- `checkpoint_and_recovery.ipynb`: 4 peer processes, a SIGKILL mid-run, a re-plan, a fetched checkpoint.
- `modes.ipynb`: three jobs (pipeline, sync_backup, ist) one after the other on one swarm of 4 peers.

Both are behind the slow marker (`make test-notebooks`): each starts 4 peer processes and trains for
minutes of wall time on a loaded 2-core host (the recovery notebook waits for learning, a kill, a re-plan
and new evaluations; the modes notebook trains three jobs), too long for the default suite's budget.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import ravnest_p2p
from ravnest_p2p.lab.launcher import stop_swarm

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
MODES_PREFIX = "rvnbmode"  # the lab prefix modes.ipynb uses (as root)


def keep_plot(path: Path) -> None:
    """Check a plot the notebook saved; with RAVNEST_WRITE_RESULTS=1 keep it next to the notebooks (docs)."""
    assert path.read_bytes().startswith(b"\x89PNG"), path
    if os.environ.get("RAVNEST_WRITE_RESULTS"):
        shutil.copy(path, NOTEBOOKS / path.name)


def run_notebook(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Execute notebooks/<name> in `tmp_path`; return the text of its outputs."""
    src = str(Path(ravnest_p2p.__file__).resolve().parents[1])  # this checkout, for kernel and peers
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    try:
        client.execute()  # raises CellExecutionError, with the failing cell, if an assert fails
    finally:
        nbformat.write(notebook, tmp_path / name)  # the executed notebook, outputs and all, to read
    outputs = [out for cell in notebook.cells for out in cell.get("outputs", [])]
    assert any("image/png" in out.get("data", {}) for out in outputs)
    return "".join(out.get("text", "") for out in outputs)


def test_checkpoint_and_recovery_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = run_notebook("checkpoint_and_recovery.ipynb", tmp_path, monkeypatch)
    keep_plot(tmp_path / "recovery_loss.png")
    assert "after the kill" in text
    assert "model.json: step" in text


def test_modes_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        text = run_notebook("modes.ipynb", tmp_path, monkeypatch)
    finally:
        stop_swarm(MODES_PREFIX)  # the notebook's lab swarm, if a failed cell or a killed kernel left it up
    keep_plot(tmp_path / "modes_accuracy.png")
    for mode in ("pipeline", "sync_backup", "ist"):
        assert mode in text
