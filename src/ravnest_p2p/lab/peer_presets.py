"""Peer settings for labs, tests and soaks that want churn noticed in seconds, not minutes.

`FAST_MEMBERSHIP_PEER_CONFIG` is a peer config file's text (`ravnest_p2p.peer --config`): a dead peer's
record expires in 6 s and it is dropped 3 s later; gossip every 0.5 s; probes stay out of the way (every
300 s, small payloads). The defaults suit the internet (records live for minutes so a slow volunteer is
not dropped by a hiccup); these suit one machine, where every delay is the test's wall time.
"""

from __future__ import annotations

__all__ = ["FAST_MEMBERSHIP_PEER_CONFIG"]

FAST_MEMBERSHIP_PEER_CONFIG = """
record_ttl_s = 6.0
directory_refresh_s = 0.5
check_identity_free = false
job_poll_s = 0.5
status_interval_s = 30.0

[probe]
period_s = 300.0
initial_probe_bytes = 65536
max_probe_bytes = 131072

[membership]
gossip_period_s = 0.5
stable_rounds = 3
hysteresis_s = 1.0
join_delay_s = 1.0
grace_s = 3.0
agreement_timeout_s = 20.0
"""
