"""The README's "Train a model" script, run as written: it starts a swarm, trains digits, prints accuracy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ravnest_p2p
from tests.readme_snippets import script_snippets

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_training_script_runs_as_written(tmp_path: Path) -> None:
    (script,) = script_snippets()
    (tmp_path / "train.py").write_text(script)
    src = str(Path(ravnest_p2p.__file__).resolve().parents[1])  # this checkout, for the peers too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    accuracy = re.search(r"^test accuracy: ([\d.]+)%$", proc.stdout, re.MULTILINE)
    assert accuracy is not None, proc.stdout[-3000:]
    assert float(accuracy.group(1)) >= 90.0
    assert "3 peers" in proc.stdout
    assert re.search(r"^\d\d:\d\d:\d\d digits-1 epoch \d+ \| c0 step \d+ ", proc.stdout, re.MULTILINE)
