"""The lab: emulate a heterogeneous volunteer swarm on one machine.

Profiles (`profiles`) describe peers' links and CPUs; `netns.NetnsLab` builds one network namespace per
peer with shaped links; `throttle.ComputeThrottle` slows a peer's CPU; `rawtransfer` measures a link.
"""

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
from ravnest_p2p.lab.throttle import ComputeThrottle, ThrottleBackend, detect_backend, thread_env

__all__ = [
    "ComputeThrottle",
    "NetnsLab",
    "PeerProfile",
    "ShapingMode",
    "SwarmProfile",
    "ThrottleBackend",
    "TransferResult",
    "WorkloadProfile",
    "detect_backend",
    "lab_address",
    "load_profile",
    "parse_profile",
    "receive_once",
    "remove_leftovers",
    "send_bytes",
    "thread_env",
]
