"""Bandwidth probe accuracy: our `NetworkMeter`'s reading vs. the rate the lab shapes the link to.

Two namespaces with symmetric links at R Mbit/s (htb; R = 20/50/100/200); one serves the probe RPCs,
the other probes it with the default `ProbeConfig` (one line per probe, no EMA). Reported: the median
reading / R ("raw"), and / (0.957 R) ("goodput"): a TCP payload runs at 1448/1514 of the wire rate the
qdisc enforces, so 0.957 is what a perfect probe of application bytes would read. Goal: 0.85-1.15.
"""

from __future__ import annotations

import statistics
import sys

from benchmarks.harness import record
from benchmarks.labrun import LabRun

PAYLOAD_FACTOR = 0.957


def _one_rate(rate_mbps: float, rounds: int) -> dict[str, float]:
    with LabRun([rate_mbps, rate_mbps]) as lab:
        lab.start(0, [sys.executable, "-m", "benchmarks.probe_peer", "serve", "--host", lab.addresses[0]])
        server = lab.wait_json(0, "maddrs", timeout_s=90)[0]["maddrs"][0]
        probe = [sys.executable, "-m", "benchmarks.probe_peer", "probe", "--host", lab.addresses[1]]
        lab.start(1, [*probe, "--server", server, "--rounds", str(rounds)])
        lines = lab.wait_json(1, "upload_mbps", timeout_s=60 + rounds * 20, count=rounds)
    ups = [line["upload_mbps"] for line in lines[1:]]  # the first probe also grows the payload
    downs = [line["download_mbps"] for line in lines[1:]]
    up, down = statistics.median(ups), statistics.median(downs)
    return {
        "rate_mbps": rate_mbps,
        "upload_mbps": up,
        "download_mbps": down,
        "upload_raw": up / rate_mbps,
        "download_raw": down / rate_mbps,
        "upload_goodput": up / (rate_mbps * PAYLOAD_FACTOR),
        "download_goodput": down / (rate_mbps * PAYLOAD_FACTOR),
        "first_probe_upload_raw": lines[0]["upload_mbps"] / rate_mbps,
        "probe_bytes": lines[-1]["probe_bytes"],
        "probes": len(ups),
    }


def main(quick: bool) -> None:
    rates = [20.0, 200.0] if quick else [20.0, 50.0, 100.0, 200.0]
    rows = [_one_rate(rate, 3 if quick else 5) for rate in rates]
    for row in rows:
        print(
            f"  {row['rate_mbps']:.0f} Mbit/s: "
            f"up {row['upload_raw']:.2f} down {row['download_raw']:.2f} (raw)"
        )
    record(
        "probe",
        rows,
        notes=(
            "Probe reading / configured htb rate, two lab namespaces with symmetric links, default "
            "ProbeConfig "
            "(min_transfer_s 0.25, payload <= 8 MiB), median of the probes after the first. raw = / rate; "
            "goodput = / (0.957 rate), the TCP payload share of the wire rate. Goal 0.85-1.15."
        ),
    )
