"""Smoke test of the churn soak benchmark (`benchmarks.bench_churn_soak`) in its short mode: 120 s of churn
(one SIGKILL with the default seed) and 120 s undisturbed in the lab; the results exist and the
useful-compute fraction is computed. The full-length run is a benchmark, not a test (docs/churn-soak.md).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.lab._support import requires_netns

pytestmark = [pytest.mark.slow, *requires_netns, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]


def soak_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("rvs")}


def test_the_short_churn_soak_writes_its_results_and_the_fraction(tmp_path: Path):
    before = soak_namespaces()
    results = tmp_path / "results"
    argv = [sys.executable, "-m", "benchmarks.bench_churn_soak", "--duration-s", "120", "--part", "soak"]
    argv += ["--results-dir", str(results), "--workdir", str(tmp_path / "work")]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    payload = json.loads((results / "churn_soak.json").read_text())
    fraction = payload["useful_compute_fraction"]
    print(f"short soak: useful-compute fraction {fraction:.3f}; {payload['breakdown']}")
    assert math.isfinite(fraction)
    assert 0 < fraction < 1.5
    assert payload["undisturbed"]["useful_samples"] > 0
    assert [e["action"] for e in payload["churn"]["events"]] == [e["action"] for e in payload["schedule"]]
    assert (results / "churn_soak.md").read_text().startswith("## churn_soak")
    assert (results / "churn_soak.png").stat().st_size > 10_000
    assert soak_namespaces() <= before  # the lab removed its namespaces
