"""The lab: emulate a heterogeneous volunteer swarm on one machine.

Profiles (`profiles`) describe peers' links and CPUs; `netns.NetnsLab` builds one network namespace per
peer with shaped links; `throttle.ComputeThrottle` slows a peer's CPU; `rawtransfer` measures a link.

Names are loaded lazily: ``python -m ravnest_p2p.lab.rawtransfer`` (and ``.throttle``) must not find
their own module already imported by this package, or runpy warns and runs a second copy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ravnest_p2p.lab.netns import NetnsLab, lab_address, remove_leftovers
    from ravnest_p2p.lab.profiles import (
        PeerProfile,
        ShapingMode,
        SwarmProfile,
        WorkloadProfile,
        load_profile,
        parse_profile,
    )
    from ravnest_p2p.lab.rawtransfer import TransferResult, receive_once, send_bytes
    from ravnest_p2p.lab.throttle import (
        ComputeThrottle,
        ThrottleBackend,
        base_cpus_to_fit,
        detect_backend,
        remove_groups,
        thread_env,
    )

__all__ = [
    "ComputeThrottle",
    "NetnsLab",
    "PeerProfile",
    "ShapingMode",
    "SwarmProfile",
    "ThrottleBackend",
    "TransferResult",
    "WorkloadProfile",
    "base_cpus_to_fit",
    "detect_backend",
    "lab_address",
    "load_profile",
    "parse_profile",
    "receive_once",
    "remove_groups",
    "remove_leftovers",
    "send_bytes",
    "thread_env",
]

_MODULE_OF = {
    **dict.fromkeys(["NetnsLab", "lab_address", "remove_leftovers"], "netns"),
    **dict.fromkeys(
        ["PeerProfile", "ShapingMode", "SwarmProfile", "WorkloadProfile", "load_profile", "parse_profile"],
        "profiles",
    ),
    **dict.fromkeys(["TransferResult", "receive_once", "send_bytes"], "rawtransfer"),
    **dict.fromkeys(
        [
            "ComputeThrottle",
            "ThrottleBackend",
            "base_cpus_to_fit",
            "detect_backend",
            "remove_groups",
            "thread_env",
        ],
        "throttle",
    ),
}
assert set(_MODULE_OF) == set(__all__)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
