"""One run of the churn soak in the lab: 8 peers in network namespaces (htb, 100 Mbit/s), a researcher in a
ninth (`benchmarks.soak_driver`), and the churn applied from the root namespace by pid.

`run_in_lab` starts the lab and the peers, lets the driver publish the job, and once the driver reports
that the first plan trains (t0) applies the churn events at t0 + at_s: ``kill`` = SIGKILL of a random
running peer's process group, ``term`` = SIGTERM to its process (a graceful leave: it hands its state
over and exits; SIGKILL of the group after 90 s), ``join`` = restart the peer that left longest ago with
the same identity. Peer 0 (every peer's initial peer) never leaves. With ``kill_at_position`` instead,
one SIGKILL hits the last stage of cluster 1 once the job's data position reaches it (the issue's kill
-9 acceptance run). Everything started is stopped by pid; the lab removes its namespaces.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.churn_accounting import ChurnEvent
from ravnest_p2p.lab import NetnsLab, parse_profile
from ravnest_p2p.lab.peer_presets import FAST_MEMBERSHIP_PEER_CONFIG
from ravnest_p2p.lab.throttle import thread_env
from ravnest_p2p.swarm import poll_until
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.transport import load_or_create_identity

__all__ = ["NUM_PEERS", "PEER_CONFIG", "load_run", "read_timeline", "run_in_lab"]

REPO = Path(__file__).resolve().parents[1]
PORT = 31900
NUM_PEERS = 8
LINK_MBPS = 100.0
TERM_GRACE_S = 90.0
# fast membership (as the e2e elastic tests): a dead peer's record expires in 6 s, dropped 3 s later
PEER_CONFIG = FAST_MEMBERSHIP_PEER_CONFIG


def read_timeline(path: Path) -> list[dict[str, Any]]:
    """The driver's JSON lines so far (a half-written last line is skipped)."""
    out = []
    try:
        text = path.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_in_lab(
    workdir: Path,
    *,
    run_id: str,
    job: JobSpec,
    duration_s: float,
    events: Sequence[ChurnEvent] = (),
    seed: int = 0,
    kill_at_position: int | None = None,
) -> dict[str, Any]:
    """Run `job` in a fresh lab under `events` (or one kill at `kill_at_position`); return the record.

    Returns:
        ``timeline`` (the driver's lines), ``final`` (the done metrics), ``events`` (what was applied:
        wall time, action, peer index, peer id), ``loadavg`` (1-minute load samples of the host).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + 1)
    ids = [load_or_create_identity(workdir / f"id{i}.key") for i in range(NUM_PEERS)]
    index_of = {ident.peer_id: i for i, ident in enumerate(ids)}
    config = workdir / "peer.toml"
    config.write_text(PEER_CONFIG)
    link = {"upload_mbps": LINK_MBPS, "download_mbps": LINK_MBPS}
    peers = [{"name": f"s{i}", **link} for i in range(NUM_PEERS)]
    profile = parse_profile(
        {"run_id": run_id, "shaping": "htb", "peers": [*peers, {"name": "researcher", **link}]},
        source="bench",
    )
    timeline_path, out = workdir / "timeline.jsonl", workdir / "driver.json"
    applied: list[dict[str, Any]] = []
    loadavg: list[float] = []
    with NetnsLab(profile, prefix="rvs" + os.urandom(2).hex()) as lab:
        maddrs = [f"/ip4/{lab.address_of(i)}/tcp/{PORT}/p2p/{ids[i].peer_id}" for i in range(NUM_PEERS)]
        procs: dict[int, subprocess.Popen[bytes]] = {}
        leaving: dict[int, float] = {}  # SIGTERM'd index -> when
        away: list[int] = []  # left, in order

        def start(i: int) -> None:
            addr = f"/ip4/{lab.address_of(i)}/tcp/{PORT}"
            argv = [sys.executable, "-m", "ravnest_p2p.peer", "--run-id", run_id, "--config", str(config)]
            argv += ["--identity-path", str(ids[i].path), "--host-maddrs", addr, "--announce-maddrs", addr]
            if i > 0:
                argv += ["--initial-peers", maddrs[0]]
            procs[i] = lab.run_in_ns(i, argv, env=thread_env(1), log_path=workdir / f"peer{i}.log")

        def reap() -> None:
            for i, since in list(leaving.items()):
                if procs[i].poll() is not None or time.monotonic() - since > TERM_GRACE_S:
                    _kill_group(procs[i].pid)  # its daemon, or the whole peer after the grace
                    procs[i].wait(timeout=30)
                    del leaving[i]

        def apply(action: str, victim: int | None = None) -> None:
            reap()
            if action == "join":
                if not away:
                    return
                i = away[0]
                if i in leaving:  # still handing over: give it the rest of its grace

                    def gone(i: int = i) -> bool:
                        reap()
                        return i not in leaving

                    poll_until(gone, TERM_GRACE_S + 35, what=f"peer {i}")
                away.remove(i)
                start(i)
            else:
                running = [i for i in procs if i not in away and i != 0]
                i = victim if victim is not None else rng.choice(sorted(running))
                if action == "kill":
                    _kill_group(procs[i].pid)
                    procs[i].wait(timeout=30)
                else:
                    procs[i].send_signal(signal.SIGTERM)
                    leaving[i] = time.monotonic()
                away.append(i)
            applied.append({"t": time.time(), "action": action, "peer": i, "peer_id": ids[i].peer_id})
            print(f"  {time.strftime('%H:%M:%S')} {run_id}: {action} peer {i}", flush=True)

        for i in range(NUM_PEERS):
            start(i)
            if i == 0:
                poll_until(
                    lambda: "join with" in (workdir / "peer0.log").read_text(errors="replace"),
                    120,
                    what="peer 0",
                )
        argv = [sys.executable, "-m", "benchmarks.soak_driver", "--initial-peers", *maddrs]
        argv += ["--run-id", run_id, "--num-peers", str(NUM_PEERS), "--job", job.model_dump_json()]
        argv += ["--timeline", str(timeline_path), "--out", str(out), "--duration-s", str(duration_s)]
        driver = lab.run_in_ns(NUM_PEERS, argv, env=thread_env(1), log_path=workdir / "driver.log", cwd=REPO)

        def started() -> float | None:
            return next(
                (line["t"] for line in read_timeline(timeline_path) if line["kind"] == "started"), None
            )

        poll_until(
            lambda: started() is not None or driver.poll() is not None, 900, what="training", interval_s=1
        )
        t0 = started()
        print(f"  {time.strftime('%H:%M:%S')} {run_id}: training", flush=True)
        pending = list(events)
        next_load = 0.0
        while driver.poll() is None and t0 is not None:
            now = time.time()
            if now >= next_load:
                loadavg.append(os.getloadavg()[0])
                next_load = now + 10
            if pending and now >= t0 + pending[0].at_s:
                apply(pending.pop(0).action)
            if kill_at_position is not None and not applied:
                polls = [line for line in read_timeline(timeline_path) if line["kind"] == "poll"]
                last = polls[-1] if polls else None
                if (
                    last
                    and max((r["micro_batches"] for r in last["progress"]), default=0) >= kill_at_position
                ):
                    cluster1 = [(s, p) for _, c, s, p in last["plan"] if c == 1]
                    if cluster1:
                        apply("kill", victim=index_of[max(cluster1)[1]])
            reap()
            time.sleep(0.5)  # the churn schedule's clock; the driver's exit ends the loop
        if driver.wait() != 0 or t0 is None:
            raise RuntimeError(f"soak driver failed: {(workdir / 'driver.log').read_text()[-3000:]}")
    (workdir / "run.json").write_text(json.dumps({"events": applied, "loadavg": loadavg}))
    return load_run(workdir)


def load_run(workdir: Path) -> dict[str, Any]:
    """A finished run's record from its work directory (the driver's output, timeline, events applied)."""
    result: dict[str, Any] = json.loads((workdir / "driver.json").read_text())
    result.update(json.loads((workdir / "run.json").read_text()))
    result.update(timeline=read_timeline(workdir / "timeline.jsonl"), workdir=str(workdir))
    return result
