"""A job trains on local data the test made: a text file, then a data set saved with `datasets`.

Two real peers (p2p daemons, in this process) run a two-stage char-GPT on an explicit assignment; each
job's data set is pinned by digest on the client (`pin_digest`), and every stage loads and checks it.
The held-out loss at the end must be far below an untrained model's (ln of the vocabulary).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from pathlib import Path

import pytest

from ravnest_p2p.client import RunClient
from ravnest_p2p.membership import MembershipConfig
from ravnest_p2p.node import Peer, PeerConfig
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.datasets import pin_digest
from ravnest_p2p.training.job import JobSpec, StagePlacement

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TEXT = "".join(f"line {i % 7}: the quick brown fox jumps over the lazy dog.\n" for i in range(120))
VOCAB = len(set(TEXT))
PEER = {
    "run_id": "local-data",
    "record_ttl_s": 8.0,
    "directory_refresh_s": 0.5,
    "check_identity_free": False,
    "job_poll_s": 0.5,
    "membership": MembershipConfig(enabled=False),
}


def lm_job(job_id: str, dataset: str, config: dict[str, object], peers: list[Peer]) -> JobSpec:
    return JobSpec(
        job_id=job_id,
        model="char_gpt",
        model_params={"vocab_size": VOCAB + 1, "block_size": 32, "embed_dim": 48},
        dataset=dataset,
        dataset_config={"block_size": 32, "tokenizer": {"kind": "char"}, **config},
        batch_size=16,
        num_epochs=50,
        max_steps=60,
        optimizer=OptimizerConfig(name="adam", lr=3e-3),
        assignment=(
            (
                StagePlacement(peer_id=peers[0].peer_id, first_layer=0, end_layer=2),
                StagePlacement(peer_id=peers[1].peer_id, first_layer=2, end_layer=4),
            ),
        ),
    )


async def test_jobs_train_on_a_text_file_and_on_a_saved_datasets_data_set(tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    (tmp_path / "corpus.txt").write_text(TEXT)
    lines = TEXT.splitlines()
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": lines[:100]}),
            "test": datasets.Dataset.from_dict({"text": lines[100:]}),
        }
    ).save_to_disk(str(tmp_path / "saved"))

    peers: list[Peer] = []
    try:
        peers.append(await Peer.start(PeerConfig(**PEER)))
        peers.append(await Peer.start(PeerConfig(**PEER, initial_peers=tuple(peers[0].maddrs))))
        async with await RunClient.connect(peers[0].maddrs, "local-data") as client:
            await client.wait_for_peers(2, timeout_s=60, measured=False)
            jobs = [
                lm_job("text-file", "text_files", {"path": str(tmp_path / "corpus.txt")}, peers),
                lm_job(
                    "saved-ds",
                    "hf_disk",
                    {"path": str(tmp_path / "saved"), "text_column": "text", "val_split": "test"},
                    peers,
                ),
            ]
            for job in jobs:
                pinned = pin_digest(job)  # the researcher's copy fixes what every peer must derive
                await client.publish_job(pinned)
                final = await client.wait_for_job(pinned, timeout_s=180, poll_s=0.5)
                last = [m for m in final if m.stage == 1]
                assert last
                assert all(m.done and m.step == 60 for m in last), last
                firsts = [m for m in final if m.stage == 0]
                print(
                    f"{job.job_id}: held-out loss {[m.eval_loss for m in firsts]} "
                    f"(untrained ~{math.log(VOCAB):.2f})"
                )
                assert all(m.eval_loss is not None and m.eval_loss < 0.5 * math.log(VOCAB) for m in firsts), (
                    job.job_id,
                    firsts,
                )
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(p.aclose() for p in peers), return_exceptions=True), 60)
