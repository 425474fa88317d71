"""Benchmark harness: machine facts, repeats, medians, and results written as JSON + a markdown table.

Every benchmark reports ratios measured in one run (ours vs. a baseline vs. a bound), never absolute
numbers compared across runs: this machine is small and noisy.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        facts["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False, timeout=5
        ).stdout.strip()
    except OSError:
        pass
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return facts


def repeat(fn: Callable[[], float], repeats: int) -> dict[str, float]:
    """Call `fn` (returning one measurement) `repeats` times; return median, min, max."""
    values = [fn() for _ in range(repeats)]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)\n"
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in columns:
                columns.append(key)

    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def record(
    name: str, rows: Sequence[dict[str, Any]], *, notes: str = "", results_dir: Path | None = None
) -> Path:
    """Write `<name>.json` and `<name>.md` under benchmarks/results/ and return the JSON path."""
    out_dir = results_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": machine_facts(), "notes": notes, "rows": list(rows)}
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md = f"## {name}\n\n{notes}\n\n{_markdown_table(rows)}"
    (out_dir / f"{name}.md").write_text(md)
    return json_path


def write_index(results_dir: Path | None = None) -> Path:
    """Concatenate every `<name>.md` into results/README.md (the table the top-level README links)."""
    out_dir = results_dir or RESULTS_DIR
    parts = ["# Benchmark results\n\nWritten by `make bench`; each section is one benchmark's latest run.\n"]
    parts += [p.read_text() for p in sorted(out_dir.glob("*.md")) if p.name != "README.md"]
    index = out_dir / "README.md"
    index.write_text("\n".join(parts))
    return index
