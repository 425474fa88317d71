"""End to end on the lab: 2 clusters x 3 stages of peer processes, each in its own network namespace
behind a 100 Mbit/s shaped link, train the digits CNN with periodic averaging; both clusters reach 97 %
held-out accuracy, and after the closing averaging round their parameters are bit-identical.

Agreement is checked on what the peers publish when done: a digest of every averaged tensor by global
name (`training.replicas.tensor_digests`). The clusters cut the model at different layers, so the test
joins each cluster's stages into one name -> digest map and compares the two maps.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from ravnest_p2p.lab import NetnsLab, parse_profile
from ravnest_p2p.lab.throttle import thread_env
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.swarm import poll_until
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.training.replicas import FINAL_ROUND
from ravnest_p2p.training.stages import load_dataset, steps_per_cluster
from ravnest_p2p.transport import load_or_create_identity
from tests.integration.lab._support import assert_no_leftovers, requires_netns

pytestmark = [*requires_netns, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[3]
PORT = 31337
RUN_ID = "labtrain"
LINK_MBPS = 100.0
NUM_PEERS = 6
PEER_CONFIG = """
status_interval_s = 30.0
check_identity_free = false
[membership]
enabled = false
"""
# the clusters cut the 4 layers differently, so the rings average 4 shards (layers 0, 1, 2, 3)
SPLITS = ([(0, 1), (1, 2), (2, 4)], [(0, 2), (2, 3), (3, 4)])


def both_replicas_rounds(log: str) -> int:
    """Periodic rounds (not the closing one) that a peer finished with both clusters in its rings."""
    rounds = re.findall(r"averaging round (\d+) finished in [0-9.]+s with 2 of 2 replicas", log)
    return sum(int(r) != FINAL_ROUND for r in rounds)


def lab_prefix() -> str:
    return "rvh2" + os.urandom(2).hex()


def test_two_clusters_train_on_the_lab_and_agree_after_the_final_round(tmp_path: Path):
    ids = [load_or_create_identity(tmp_path / f"id{i}.key") for i in range(NUM_PEERS)]
    assignment = tuple(
        tuple(
            StagePlacement(peer_id=ids[c * 3 + s].peer_id, first_layer=first, end_layer=end)
            for s, (first, end) in enumerate(split)
        )
        for c, split in enumerate(SPLITS)
    )
    job = JobSpec(
        job_id="labtwo",
        model="digits_cnn",
        dataset="digits",
        batch_size=32,
        num_epochs=24,  # 16 epochs: 96.4-98.1 % in 4 runs, too close to the bar; 24: 97.5-98.3 % in 6
        seed=1,
        averaging_period_s=1.0,  # by wall clock: the two clusters run at different speeds
        assignment=assignment,
    )
    # a decaying learning rate: with a constant 3e-3, 2 of 4 runs ended at 97.5 % (97.5-98.3 %), too close
    steps = steps_per_cluster(job, len(load_dataset(job)[0]), len(SPLITS))
    optimizer = OptimizerConfig(
        name="adam", lr=3e-3, schedule="warmup_cosine", warmup_steps=20, total_steps=steps
    )
    job = job.model_copy(update={"optimizer": optimizer})
    config = tmp_path / "peer.toml"
    config.write_text(PEER_CONFIG)
    link = {"upload_mbps": LINK_MBPS, "download_mbps": LINK_MBPS}
    profile = parse_profile(
        {
            "run_id": RUN_ID,
            "shaping": "htb",
            "peers": [*({"name": f"s{i}", **link} for i in range(NUM_PEERS)), {"name": "researcher", **link}],
        },
        source="test",
    )
    prefix = lab_prefix()
    pids: list[int] = []
    with NetnsLab(profile, prefix=prefix) as lab:
        maddrs = [f"/ip4/{lab.address_of(i)}/tcp/{PORT}/p2p/{ids[i].peer_id}" for i in range(NUM_PEERS)]
        for i in range(NUM_PEERS):
            addr = f"/ip4/{lab.address_of(i)}/tcp/{PORT}"
            argv = [sys.executable, "-m", "ravnest_p2p.peer", "--run-id", RUN_ID, "--config", str(config)]
            argv += ["--identity-path", str(ids[i].path), "--host-maddrs", addr, "--announce-maddrs", addr]
            if i > 0:
                argv += ["--initial-peers", maddrs[0]]
            log = tmp_path / f"peer{i}.log"
            lab.run_in_ns(i, argv, env=thread_env(1), log_path=log)
            if i == 0:
                poll_until(
                    lambda path=log: "join with" in path.read_text(errors="replace"),
                    90,
                    what="peer 0 to start",
                )
        out = tmp_path / "driver.json"
        # the researcher knows every peer: a DHT client bootstrapped from one peer alone was seen to read
        # a stale metrics dictionary for minutes (the bootstrap's own final record missing)
        argv = [sys.executable, "-m", "tests.integration.lab._job_driver", "--initial-peers", *maddrs]
        argv += ["--run-id", RUN_ID, "--job", job.model_dump_json(), "--out", str(out), "--timeout-s", "420"]
        driver = lab.run_in_ns(NUM_PEERS, argv, env=thread_env(1), log_path=tmp_path / "driver.log", cwd=REPO)
        poll_until(lambda: driver.poll() is not None, 500, what="the job", interval_s=1)
        logs = {p.stem: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
        assert driver.returncode == 0, {name: text[-3000:] for name, text in logs.items()}
        pids = lab.pids
    assert_no_leftovers(prefix, pids)

    final = [StageMetrics.model_validate(m) for m in json.loads(out.read_text())]
    assert len(final) == NUM_PEERS, final
    assert all(m.done and not m.failed for m in final), final
    firsts = sorted((m for m in final if m.stage == 0), key=lambda m: m.cluster)
    print("accuracy", [m.eval_accuracy for m in firsts], "rounds", [m.averaging_rounds for m in final])
    for m in firsts:
        assert m.eval_accuracy is not None
        assert m.eval_accuracy >= 0.97, firsts
    # the closing round had both clusters in every ring; before it, periodic rounds paired up too
    assert all(m.last_round == FINAL_ROUND and m.last_round_participants == 2 for m in final), final
    paired = {name: both_replicas_rounds(text) for name, text in logs.items() if name.startswith("peer")}
    print("periodic rounds with both replicas, per peer:", paired)
    assert all(n >= 1 for n in paired.values()), paired
    by_cluster: list[dict[str, str]] = [{}, {}]
    for m in final:
        assert m.param_digests, m
        by_cluster[m.cluster].update(m.param_digests)
    assert set(by_cluster[0]) == set(by_cluster[1])
    differ = sorted(name for name, digest in by_cluster[0].items() if by_cluster[1][name] != digest)
    assert not differ, differ
