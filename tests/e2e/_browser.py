"""Headless Chromium for the dashboard's e2e tests: the command line and a flattened rendered DOM."""

from __future__ import annotations

import shutil
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SKIP_REASON = "chromium is not installed (apt-get install chromium)"


def chromium_argv(*args: str, profile: Path) -> list[str]:
    """Chromium, headless, as root in a container (no sandbox, no GPU), with a fresh profile; the page gets
    6 s of virtual time to poll and render before the DOM is dumped or the screenshot taken."""
    assert CHROMIUM is not None
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
    return argv + [f"--user-data-dir={profile}", "--no-first-run", "--virtual-time-budget=6000", *args]


_VOID = ("br", "meta", "line", "polyline", "link", "img", "input")


class Dom(HTMLParser):
    """The rendered DOM, flattened: text by element id, and the classes of every table row."""

    def __init__(self) -> None:
        super().__init__()
        self.text_by_id: dict[str, str] = {}
        self.row_classes: list[str] = []
        self.polylines = 0
        self._open: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        if tag == "tr":
            self.row_classes.append(attr.get("class") or "")
        if tag == "polyline":
            self.polylines += 1
        if tag not in _VOID:
            self._open.append(attr.get("id"))
            if attr.get("id"):
                self.text_by_id.setdefault(attr["id"] or "", "")

    def handle_endtag(self, tag: str) -> None:
        if self._open and tag not in _VOID:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for element_id in self._open:
            if element_id:
                self.text_by_id[element_id] += data


def parse_dom(html: str) -> Dom:
    dom = Dom()
    dom.feed(html)
    return dom


def assert_swarm_page(dom: Dom, *, run_id: str, job_id: str, num_peers: int, num_clusters: int) -> None:
    """What the page must show of a training swarm: every peer, the plan, the job and its progress."""
    text = dom.text_by_id
    assert text["run-id"] == run_id
    assert text["job-id"] == job_id
    assert text["num-peers"] == str(num_peers)
    assert dom.row_classes.count("peer-row") == num_peers
    assert dom.row_classes.count("cluster-row") == num_clusters >= 1
    assert dom.row_classes.count("job-cluster-row") >= 1
    assert dom.row_classes.count("averaging-row") >= 2
    assert int(text["job-progress"]) > 0
    assert "agree on plan" in text["plan-agree"]
    assert dom.polylines >= 2  # a loss and a samples/s line at least
    assert text["error"] == ""
    # the active job's mode; every peer serves the built-in model and data set, so every one is fit
    assert text["job-mode"] == "pipeline"
    assert text["job-unfit"] == ""
    assert text["peers"].count("built-ins only") == num_peers
    assert text["peers"].count("fit") == num_peers
    assert "unfit" not in text["peers"]


def shows_training(state: dict[str, Any], *, num_peers: int) -> bool:
    """Whether a `/api/state` snapshot shows every peer, a plan and the job training with some history."""
    job = state.get("job")
    history = state.get("history", {})
    points = [p for series in history.values() for p in series if p["loss"] is not None]
    return bool(
        len(state.get("peers", [])) == num_peers
        and state["plan"]["clusters"]
        and job is not None
        and job["clusters"]
        and len(points) >= 3
    )
