"""Run training jobs on real peer processes in lab namespaces, driven by a researcher in its own namespace.

Shared by the pipeline-throughput and averaging-overlap benchmarks: N stage peers (one namespace each,
htb-shaped links, every peer CPU-capped by cgroup to the same share), plus one namespace for
`benchmarks.pipeline_driver`, which publishes the jobs and returns every stage's final metrics.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ravnest_p2p.lab import NetnsLab, parse_profile
from ravnest_p2p.lab.throttle import base_cpus_to_fit, thread_env
from ravnest_p2p.swarm import poll_until
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.transport import load_or_create_identity

PORT = 31337
REPO = Path(__file__).resolve().parents[1]


def run_jobs(
    *,
    num_peers: int,
    link_mbps: float,
    job: JobSpec,
    split: Sequence[tuple[int, int]],
    runs: Sequence[str],
    workdir: Path,
    cpus: float = 1.8,
    timeout_s: float = 1200,
    run_id: str = "labtrain",
    prefix: str | None = None,
    updates: Sequence[dict[str, Any]] | None = None,
    trace: bool = False,
) -> list[dict[str, Any]]:
    """Start the lab, train `runs` (`pipeline_driver --runs`) on clusters of len(split) peers; tear down.

    `prefix`: the lab's namespace prefix (at most 8 characters; default "rvl" + 4 random hex digits);
    `updates`: per run, JobSpec fields to set (`pipeline_driver --updates`); `trace`: every run's result
    also holds every metrics poll (`pipeline_driver --trace`).
    """
    peers = [
        {"name": f"s{i}", "upload_mbps": link_mbps, "download_mbps": link_mbps} for i in range(num_peers)
    ]
    profile = parse_profile(
        {"run_id": run_id, "shaping": "htb", "peers": [*peers, {"name": "researcher"}]}, source="bench"
    )
    ids = [load_or_create_identity(workdir / f"id{i}.key") for i in range(num_peers)]
    base_cpus = base_cpus_to_fit([1.0] * num_peers, num_cpus=cpus)
    with NetnsLab(profile, prefix=prefix or "rvl" + os.urandom(2).hex()) as lab:
        throttles = []
        maddrs = [f"/ip4/{lab.address_of(i)}/tcp/{PORT}/p2p/{ids[i].peer_id}" for i in range(num_peers)]
        try:
            for i in range(num_peers):
                throttle = lab.throttle_for(i, base_cpus=base_cpus)
                throttle.create()
                throttles.append(throttle)
                addr = f"/ip4/{lab.address_of(i)}/tcp/{PORT}"
                argv = [sys.executable, "-m", "ravnest_p2p.peer", "--run-id", run_id]
                argv += [
                    "--identity-path",
                    str(ids[i].path),
                    "--host-maddrs",
                    addr,
                    "--announce-maddrs",
                    addr,
                ]
                if i > 0:
                    argv += ["--initial-peers", maddrs[0]]
                log = workdir / f"peer{i}.log"
                lab.run_in_ns(i, argv, env=thread_env(1), log_path=log, throttle=throttle)
                if i == 0:
                    poll_until(
                        lambda path=log: "join with" in path.read_text(errors="replace"),
                        90,
                        what="peer 0 to start",
                    )
            out = workdir / "driver.json"
            argv = [sys.executable, "-m", "benchmarks.pipeline_driver", "--initial-peers", maddrs[0]]
            argv += ["--run-id", run_id, "--stage-peers", *[i.peer_id for i in ids]]
            argv += ["--split", json.dumps(list(split)), "--job", job.model_dump_json(), "--out", str(out)]
            argv += ["--timeout-s", str(timeout_s), "--runs", *runs]
            if updates is not None:
                argv += ["--updates", json.dumps(list(updates))]
            argv += ["--trace"] if trace else []
            driver = lab.run_in_ns(num_peers, argv, log_path=workdir / "driver.log", cwd=str(REPO))
            poll_until(lambda: driver.poll() is not None, timeout_s + 120, what="the driver", interval_s=1)
            if driver.returncode != 0:
                raise RuntimeError((workdir / "driver.log").read_text()[-3000:])
            results: list[dict[str, Any]] = json.loads(out.read_text())
            return results
        finally:
            for throttle in throttles:
                throttle.close()
