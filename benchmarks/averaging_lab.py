"""Our ring vs hivemind's DecentralizedAverager on the same lab peers, in one run, vs the ring bound.

For each link scenario one `LabRun` (4 namespaces, symmetric htb links): first our 4 ring peers
(`benchmarks.averaging_peer`, rounds started together at a wall-clock instant; round time = last end -
start), with equal chunks and, when the rates differ, again with chunks sized by the link rates, then
hivemind's 4 averagers (`benchmarks.hivemind_averager_peer`, every daemon dialled to every other first;
round time = last end - last trigger, matchmaking excluded). The bound is the ring's
2(C-1)/C * S / B_min with B_min the slowest link: at the configured (wire) rate, and at the TCP payload
rate 0.957 B that htb actually delivers (MTU 1500 headers). With rate-weighted chunks the ring's own
bound is lower: the busiest link's time under the chunks `weights.py` picks for the ring's order.
A last run paces every ring stream to `PACE` of its link's payload rate (`RingConfig.pace_fraction`).

Each system runs `WARMUP_ROUNDS` more rounds than asked and the first is reported apart
(`first_round_s`), not in the median: periodic averaging pays connection set-up once, and our first
round carried it (9.65 s against 8.75 s for the next, 4 x 100 Mbit/s), while hivemind's daemons were
dialled before its first round.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.labrun import LabRun
from ravnest_p2p.averaging import build_shard_map
from ravnest_p2p.averaging.weights import chunk_fractions, link_loads

GOODPUT = 0.957
PACE = 0.92  # RingConfig.pace_fraction of the paced runs
WARMUP_ROUNDS = 1
_OURS = [sys.executable, "-m", "benchmarks.averaging_peer"]
_THEIRS = [sys.executable, "-m", "benchmarks.hivemind_averager_peer"]


def _lines(lab: LabRun, index: int, key: str, *, without: str | None = None) -> list[dict[str, Any]]:
    return [x for x in lab.json_lines(index) if key in x and (without is None or without not in x)]


def _wait(
    lab: LabRun, index: int, key: str, count: int, timeout_s: float, without: str | None = None
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while len(found := _lines(lab, index, key, without=without)) < count:
        for proc in lab.procs.get(index, []):
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"ns {index} process exited {proc.returncode}: {lab.tail(index)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ns {index}: {count} lines with {key!r} not seen: {lab.tail(index)}")
        time.sleep(0.1)  # polling a log file, bounded by the deadline
    return found


def _write_control(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _ours(
    lab: LabRun,
    size_bytes: int,
    rounds: int,
    timeout_s: float,
    *,
    rates: list[float] | None = None,
    port: int = 31400,
    pace_fraction: float | None = None,
) -> dict[str, Any]:
    """Our ring's rounds; with `rates` (per namespace, Mbit/s) the peers size chunks by rate."""
    group = len(lab.addresses)
    control = lab.workdir / f"control-{port}.json"
    procs = []
    seen = [len(_lines(lab, i, "peer_id")) for i in range(group)]  # earlier runs' lines in the same logs
    for i, address in enumerate(lab.addresses):
        argv = [*_OURS, "--host", address, "--port", str(port), "--numel", str(size_bytes // 4)]
        argv += ["--rounds", str(rounds), "--control", str(control)]
        if pace_fraction is not None:
            argv += ["--pace-fraction", str(pace_fraction)]
        procs.append(lab.start(i, argv))
    hello = [_wait(lab, i, "peer_id", seen[i] + 1, 120)[seen[i]] for i in range(group)]
    data: dict[str, Any] = {"peers": {h["peer_id"]: h["maddrs"] for h in hello}}
    if rates is not None:
        data["rates_mbps"] = {h["peer_id"]: rate for h, rate in zip(hello, rates, strict=True)}
    done = [len(_lines(lab, i, "participants")) for i in range(group)]
    _write_control(control, data)
    times, errors = [], []
    for k in range(rounds):
        start_at = time.time() + 2.0
        data[f"round{k}"] = start_at
        _write_control(control, data)
        lines = [_wait(lab, i, "participants", done[i] + k + 1, timeout_s)[done[i] + k] for i in range(group)]
        if not all(x["participants"] == group for x in lines):
            raise RuntimeError(
                f"a round lost members: {lines}\n" + "\n".join(lab.tail(i, 3000) for i in range(group))
            )
        times.append(max(x["end_t"] for x in lines) - start_at)
        errors.append(max(x["error"] for x in lines))
    data["exit"] = True
    _write_control(control, data)
    for proc in procs:
        proc.wait(timeout=60)
    return {
        "times": times,
        "max_abs_error": max(errors),
        "MB_sent_max": max(x["bytes_sent"] for x in lines) / 1e6,
        "MB_sent_min": min(x["bytes_sent"] for x in lines) / 1e6,
        "peer_ids": [h["peer_id"] for h in hello],
    }


def weighted_bound_s(rates: list[float], peer_ids: list[str], size_bytes: int) -> float:
    """The busiest link's time (wire rate) with the chunks `weights.py` picks for the benchmark's ring."""
    (shard,) = build_shard_map([[(p, [("0.weight", 1)])] for p in sorted(peer_ids)], epoch=0).shards
    rate_of = dict(zip(peer_ids, rates, strict=True))
    ring = [rate_of[p] for p in shard.ring]
    c = len(ring)
    chunks = chunk_fractions(ring, ring)
    loads = [2 * (c - 1) / c] * c if chunks is None else [float(x) for x in link_loads(chunks)]
    links = [min(ring[i], ring[(i + 1) % c]) for i in range(c)]
    return max(load * size_bytes * 8 / (r * 1e6) for load, r in zip(loads, links, strict=True))


def _theirs(
    lab: LabRun, rates: list[float], size_bytes: int, rounds: int, timeout_s: float
) -> dict[str, Any]:
    group = len(rates)
    maddrs: list[str] = []
    procs = []
    for i, rate in enumerate(rates):
        argv = [
            *_THEIRS,
            "--host",
            lab.addresses[i],
            "--group-size",
            str(group),
            "--size-bytes",
            str(size_bytes),
        ]
        argv += ["--rounds", str(rounds), "--bandwidth-mbps", str(rate)]
        if maddrs:
            argv += ["--initial-peers", *maddrs]
        procs.append(lab.start(i, argv))
        maddrs += _wait(lab, i, "maddrs", 1, 120, without="peer_id")[0]["maddrs"]
    lines = [_wait(lab, i, "trigger_t", rounds, timeout_s) for i in range(group)]
    finals = [_wait(lab, i, "final_mean", 1, 60)[0]["final_mean"] for i in range(group)]
    times = []
    for r in range(rounds):
        per_peer = [peer_lines[r] for peer_lines in lines]
        assert all(p["ok"] and p["group"] == group for p in per_peer), per_peer
        times.append(max(p["end_t"] for p in per_peer) - max(p["trigger_t"] for p in per_peer))
    for proc in procs:
        proc.wait(timeout=60)
    expected = (group - 1) / 2  # peer i averages ones * i
    return {"times": times, "max_abs_error": max(abs(f - expected) for f in finals)}


def run_scenario(rates: list[float], size_bytes: int, rounds: int) -> list[dict[str, Any]]:
    """Rows for one link scenario: ours, hivemind's, the bound (configured and payload rate)."""
    group = len(rates)
    bound_s = 2 * (group - 1) / group * size_bytes * 8 / (min(rates) * 1e6)
    goodput_bound_s = bound_s / GOODPUT
    timeout_s = 120 + 4 * goodput_bound_s
    uniform = len(set(rates)) == 1
    rounds += WARMUP_ROUNDS
    with LabRun(rates) as lab:
        runs = []
        if not uniform:
            runs.append(("ours: RingAllReduce, equal chunks", _ours(lab, size_bytes, rounds, timeout_s)))
        weighted = _ours(lab, size_bytes, rounds, timeout_s, rates=rates, port=31410)
        label = "ours: RingAllReduce" if uniform else "ours: RingAllReduce, chunks by link rate"
        runs.append((label, weighted))
        paced = _ours(lab, size_bytes, rounds, timeout_s, rates=rates, port=31420, pace_fraction=PACE)
        runs.append((f"{label}, paced at {PACE} of the link", paced))
        if os.environ.get("AVG_LAB_OURS_ONLY"):  # for tuning: skip the baseline
            print("\n".join(lab.tail(i, 1500) for i in range(len(rates))), flush=True)
            theirs = weighted
        else:
            theirs = _theirs(lab, rates, size_bytes, rounds, timeout_s)
    runs.append(("hivemind DecentralizedAverager", theirs))
    ring_bound_s = weighted_bound_s(rates, weighted["peer_ids"], size_bytes)
    links = "/".join(f"{r:g}" for r in rates)
    theirs_s = statistics.median(theirs["times"][WARMUP_ROUNDS:])
    rows = []
    for system, run in runs:
        median = statistics.median(run["times"][WARMUP_ROUNDS:])
        rows.append(
            {
                "links_mbps": links,
                "system": system,
                "median_s": median,
                "round_times_s": [round(t, 2) for t in run["times"][WARMUP_ROUNDS:]],
                "first_round_s": round(run["times"][0], 2),
                "efficiency_vs_bound": bound_s / median,
                "efficiency_vs_goodput_bound": goodput_bound_s / median,
                "efficiency_vs_ring_bound": ring_bound_s / median,
                "vs_hivemind": median / theirs_s,
                "max_abs_error": run["max_abs_error"],
                "MB_sent_max_min": (
                    f"{run['MB_sent_max']:.1f}/{run['MB_sent_min']:.1f}" if "MB_sent_max" in run else ""
                ),
            }
        )
    rows.append(
        {
            "links_mbps": links,
            "system": "bound 2(C-1)/C*S/B_min (wire rate)",
            "median_s": bound_s,
            "efficiency_vs_bound": 1.0,
            "vs_hivemind": bound_s / theirs_s,
        }
    )
    if not uniform:
        rows.append(
            {
                "links_mbps": links,
                "system": "bound with chunks by link rate (wire rate, busiest link)",
                "median_s": ring_bound_s,
                "efficiency_vs_bound": bound_s / ring_bound_s,
                "efficiency_vs_ring_bound": 1.0,
                "vs_hivemind": ring_bound_s / theirs_s,
            }
        )
    rows.append(
        {
            "links_mbps": links,
            "system": "bound at payload rate 0.957*B_min",
            "median_s": goodput_bound_s,
            "efficiency_vs_bound": bound_s / goodput_bound_s,
            "efficiency_vs_goodput_bound": 1.0,
            "vs_hivemind": goodput_bound_s / theirs_s,
        }
    )
    return rows
