"""The volunteer image and a compose swarm of three containers training the digits job (`make docker-test`).

Behind the ``docker`` marker, never in the default suite: it needs root, Docker (a running daemon, or
dockerd installed: then the test starts one with its bridge and pools inside 198.18.0.0/15 and stops it),
debootstrap and a reachable Debian mirror and PyPI for a first build. It builds the base and the image
(docker/build.sh; cached after the first time), starts docker/compose.yaml under a fresh project name,
submits the digits job from a `RunClient` on this host as a 3-stage pipeline over the three containers,
waits for it to end with >= 97 % held-out accuracy, and tears the project down (containers, network,
volumes, by the ids it recorded) however the test ends. With RAVNEST_WRITE_RESULTS=1 it writes its
numbers to benchmarks/results/docker.{json,md}.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ravnest_p2p import (
    JobSpec,
    OptimizerConfig,
    ProgressSnapshot,
    RavnestError,
    RunClient,
    load_or_create_identity,
)
from tests.docker._docker import ALLOWED, REPO, ComposeSwarm, Daemon, docker

pytestmark = [pytest.mark.docker, pytest.mark.timeout(2400)]

IMAGE = os.environ.get("RAVNEST_DOCKER_IMAGE", "ravnest-peer:latest")
RESULTS = REPO / "benchmarks" / "results"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    if os.geteuid() != 0 or shutil.which("docker") is None:
        pytest.skip("needs root and the docker CLI")
    d = Daemon(tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    d.ensure()
    yield d
    d.stop()


def build_image() -> dict:
    existed = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode == 0
    start = time.monotonic()
    proc = subprocess.run(
        [str(REPO / "docker" / "build.sh"), IMAGE], capture_output=True, text=True, timeout=3000, check=False
    )
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    size = json.loads(docker("image", "inspect", IMAGE))[0]["Size"]
    return {"build_s": round(seconds, 1), "kind": "cached" if existed else "first", "image_mb": size / 1e6}


async def connect(swarm: ComposeSwarm, owner_key: Path, timeout_s: float = 180.0) -> RunClient:
    """Join the run once the bootstrap container listens (its first seconds go to starting Python)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await RunClient.connect(swarm.initial_peers, run_id="docker", identity_path=owner_key)
        except RavnestError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(2.0)


async def train(swarm: ComposeSwarm, owner_key: Path, up_at: float) -> dict:
    times: dict[str, float] = {}

    def on_progress(snapshot: ProgressSnapshot) -> None:
        if "first_step_s" not in times and any(c.step > 0 for c in snapshot.summary.clusters):
            times["first_step_s"] = time.monotonic() - up_at

    async with await connect(swarm, owner_key) as client:
        peers = await client.wait_for_peers(3, timeout_s=300)
        times["ready_s"] = time.monotonic() - up_at
        job = JobSpec(
            job_id="digits-docker",
            model="digits_cnn",
            dataset="digits",
            batch_size=32,
            num_epochs=8,
            optimizer=OptimizerConfig(name="adam", lr=3e-3),
            eval_every_steps=60,
        )
        job = client.plan(peers, job, min_stages=3)  # one 3-stage pipeline across the three containers
        published_at = time.monotonic()
        await client.publish_job(job)
        final = await client.wait_for_job(job, timeout_s=1200, poll_s=1.0, on_progress=on_progress)
        times["train_s"] = time.monotonic() - published_at
    summary = ProgressSnapshot(final, job.job_id).summary
    accuracies = [c.eval_accuracy for c in summary.clusters if c.eval_accuracy is not None]
    stages = {m.stage for m in final}
    return {**times, "accuracy": max(accuracies) if accuracies else None, "stages": len(stages)}


def write_results(numbers: dict) -> None:
    path = RESULTS / "docker.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[numbers["kind"]] = numbers  # keeps the first (cold) build's numbers beside the latest cached one
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    rows = [
        "| build | build s | image MB | peers ready s | first step s | job s | accuracy | load (1 min) "
        "| when (UTC) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("first", "cached"):
        if kind in data:
            n = data[kind]
            rows.append(
                f"| {kind} | {n['build_s']:.0f} | {n['image_mb']:.0f} | {n['ready_s']:.0f} | "
                f"{n['first_step_s']:.0f} | {n['train_s']:.0f} | {n['accuracy']:.1%} | "
                f"{n.get('load_1m', '-')} | {n['when']} |"
            )
    (RESULTS / "docker.md").write_text(
        "# Docker: the volunteer image and a 3-container compose swarm\n\n"
        "Written by `make docker-test` (`tests/docker/test_compose_swarm.py`). *first*: the image did not\n"
        "exist (the base image and build cache may have); *cached*: a rebuild with nothing changed. Times\n"
        "count from `compose up`; peers ready = 3 measured peers visible to the host's `RunClient`; job =\n"
        "publish to done (digits CNN, 3-stage pipeline, 8 epochs). Measured on a shared 2-core host; load\n"
        "(1 min) is the host's load average at the end of the run (other sessions' work included).\n\n"
        + "\n".join(rows)
        + "\n"
    )


def test_compose_swarm_trains_digits(daemon, tmp_path):
    if daemon.started:  # our own daemon: its default bridge is inside the allowed range too
        bridge = json.loads(docker("network", "inspect", "bridge"))[0]["IPAM"]["Config"][0]["Subnet"]
        assert ipaddress.ip_network(bridge).subnet_of(ALLOWED)
    numbers = build_image()
    owner_key = tmp_path / "owner.key"
    owner = load_or_create_identity(owner_key).peer_id
    swarm = ComposeSwarm(image=IMAGE, run_id="docker", run_owner=owner, log_dir=tmp_path / "logs")
    try:
        up_at = time.monotonic()
        swarm.up()
        for subnet in swarm.subnets():
            assert ipaddress.ip_network(subnet).subnet_of(ALLOWED), subnet
        addresses = swarm.addresses()
        assert len(addresses) == 3, addresses
        for ips in addresses.values():
            assert ips, addresses
            assert all(ipaddress.ip_address(ip) in ALLOWED for ip in ips), addresses
        numbers.update(asyncio.run(train(swarm, owner_key, up_at)))
        users = {docker("exec", cid, "id", "-u").strip() for cid in swarm.container_ids}
        assert users == {"10001"}  # the peers run as the image's non-root user
    finally:
        errors = swarm.down()
    assert not errors, errors
    assert not swarm.remaining()
    assert numbers["stages"] == 3
    numbers["when"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    numbers["load_1m"] = round(os.getloadavg()[0], 1)
    print(json.dumps(numbers))
    assert numbers["accuracy"] is not None
    assert numbers["accuracy"] >= 0.97, numbers
    if os.environ.get("RAVNEST_WRITE_RESULTS") == "1":
        write_results(numbers)
