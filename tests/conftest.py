"""Shared fixtures: reap any p2pd this test session started, whatever happened."""

from __future__ import annotations

import os

import psutil
import pytest


def _own_p2pd_pids() -> set[int]:
    me = psutil.Process(os.getpid())
    pids = set()
    for child in me.children(recursive=True):
        try:
            if child.name() == "p2pd":
                pids.add(child.pid)
        except psutil.Error:
            continue
    return pids


@pytest.fixture(scope="session", autouse=True)
def _reap_stray_daemons():
    yield
    for pid in _own_p2pd_pids():
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
