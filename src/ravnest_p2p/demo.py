"""`make demo`: three peers on loopback find each other, measure themselves, and train the digits CNN
as a 3-stage asynchronous pipeline; progress (loss, samples/s) is shown, then the test accuracy.

The run is owned: the researcher's identity (a key file) is made first, the peers start with
``--run-owner <its peer id>``, and only jobs signed with that key are trained.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ravnest_p2p.cli_common import OneLineArgumentParser
from ravnest_p2p.client import RunClient
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.status import format_table
from ravnest_p2p.swarm import LocalSwarm
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.transport import load_or_create_identity

NUM_PEERS = 3
RUN_ID = "demo"


def _progress(metrics: list[StageMetrics]) -> None:
    if not metrics:
        print("  waiting for the first metrics ...", flush=True)
        return
    first = next((m for m in metrics if m.stage == 0), None)
    last = max(metrics, key=lambda m: m.stage)
    if first is not None:
        loss = f"{last.loss:.4f}" if last.loss is not None else "-"
        print(
            f"  step {first.step:4d}  loss {loss}  {last.samples_per_s:7.1f} samples/s  "
            f"in flight {first.in_flight}",
            flush=True,
        )


async def _run(initial_peers: list[str], identity_path: Path) -> float:
    async with await RunClient.connect(initial_peers, RUN_ID, identity_path=identity_path) as client:
        records = await client.wait_for_peers(NUM_PEERS, timeout_s=120)
        print("\nmembership (measured by each peer):\n" + format_table(records), flush=True)
        job = JobSpec(
            job_id="digits-demo",
            model="digits_cnn",
            dataset="digits",
            batch_size=32,
            num_epochs=8,
            seed=0,
            optimizer=OptimizerConfig(name="adam", lr=3e-3),
            eval_every_steps=60,
        )
        job = client.plan(records[:NUM_PEERS], job, min_stages=NUM_PEERS)
        print(
            "\nplan: "
            + " -> ".join(
                f"…{s.peer_id[-6:]}[layers {s.first_layer}:{s.end_layer}]"
                for s in job.assignment[0]  # type: ignore[index]
            ),
            flush=True,
        )
        await client.publish_job(job)
        print("training (asynchronous 1F1B pipeline, no flushes):", flush=True)
        final = await client.wait_for_job(job, timeout_s=600, on_progress=_progress)
        first = next(m for m in final if m.stage == 0)
        assert first.eval_accuracy is not None
        return first.eval_accuracy


def main(argv: Sequence[str] | None = None) -> int:
    OneLineArgumentParser(  # no options: a stray flag is an error, not a demo started anyway
        prog="python -m ravnest_p2p.demo",
        description="Three peers on 127.0.0.1 train the digits CNN as a 3-stage asynchronous pipeline.",
    ).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ravnest-demo-") as tmp:
        identity_path = Path(tmp) / "owner.key"
        owner = load_or_create_identity(identity_path).peer_id
        print(f"starting {NUM_PEERS} peers on 127.0.0.1, run {RUN_ID!r} owned by {owner} ...", flush=True)
        return _demo(identity_path, owner)


def _demo(identity_path: Path, owner: str) -> int:
    with LocalSwarm(NUM_PEERS - 1, run_id=RUN_ID, run_owner=owner) as swarm:
        accuracy = asyncio.run(_run(swarm.initial_peers, identity_path))
        print(f"\nfinal test accuracy: {accuracy:.2%}", flush=True)
        codes = swarm.stop()
    print(f"shut down; exit codes: {codes}")
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
