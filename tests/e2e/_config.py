"""Peer settings the e2e tests share: fast membership, so a dead peer is noticed and re-planned in seconds.

A dead peer's record expires in 6 s and it is dropped 3 s later; probes stay out of the way (every 300 s,
small payloads).
"""

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
