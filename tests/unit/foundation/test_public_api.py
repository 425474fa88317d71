"""The root package's public API: what `from ravnest_p2p import ...` offers, pinned (as httpx does)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import ravnest_p2p

# Changing this list changes the public API: do it on purpose, with the README and the notebook.
EXPECTED = {
    "InitCheckpoint",
    "JobHistory",
    "JobSpec",
    "LocalSwarm",
    "OptimizerConfig",
    "Peer",
    "PeerConfig",
    "PeerRecord",
    "ProgressSnapshot",
    "ProgressSummary",
    "ProgressView",
    "RavnestError",
    "RunClient",
    "StageMetrics",
    "StagePlacement",
    "Swarm",
    "SwarmProfile",
    "__version__",
    "available_models",
    "evaluate_model",
    "format_table",
    "load_model",
    "load_or_create_identity",
    "load_profile",
    "summarize",
}


def test_all_is_the_pinned_list() -> None:
    assert set(ravnest_p2p.__all__) == EXPECTED
    assert len(ravnest_p2p.__all__) == len(EXPECTED)
    assert ravnest_p2p.__all__ == sorted(ravnest_p2p.__all__)


def test_every_name_resolves_to_its_defining_object() -> None:
    for name in ravnest_p2p.__all__:
        value = getattr(ravnest_p2p, name)
        if name == "__version__":
            assert isinstance(value, str)
            continue
        assert value.__module__.startswith("ravnest_p2p."), name
        module = sys.modules[value.__module__]
        assert getattr(module, name) is value, name


def test_the_package_exposes_nothing_else() -> None:
    for name in ravnest_p2p.__all__:
        getattr(ravnest_p2p, name)  # resolve every lazy name (this imports submodules too)
    public = {
        name
        for name in dir(ravnest_p2p)
        if not name.startswith("_") and not isinstance(getattr(ravnest_p2p, name), types.ModuleType)
    }
    assert public == EXPECTED - {"__version__"}


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        ravnest_p2p.NoSuchThing  # noqa: B018


def test_importing_the_package_is_cheap() -> None:
    code = "import sys, ravnest_p2p; print(sorted(m for m in ('torch', 'hivemind') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
