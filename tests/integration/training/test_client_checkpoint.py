"""RunClient.checkpoint against a short real job: the assembled state matches the digests the stages
published, loads into one process and scores the accuracy the run reported."""

from __future__ import annotations

import json

import pytest
import torch

from ravnest_p2p.client import RunClient
from ravnest_p2p.errors import RavnestError
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.checkpoint import newest_complete, read_announcements
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.model_checkpoint import evaluate_model, load_model
from ravnest_p2p.training.stage_hook import CHECKPOINT_DIR_ENV
from ravnest_p2p.training.stage_state import tensor_digest
from ravnest_p2p.utils import wait_until
from tests.integration.foundation.conftest import close_all, start_swarm

pytestmark = pytest.mark.timeout(240)


async def test_client_checkpoint_of_a_finished_job_loads_and_scores_what_the_run_reported(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(CHECKPOINT_DIR_ENV, str(tmp_path / "stages"))  # the peers keep checkpoints there
    peers = await start_swarm(2, "ckpt", job_poll_s=0.5)
    try:
        async with await RunClient.connect(peers[0].maddrs, "ckpt") as client:
            await client.wait_for_peers(2, timeout_s=60, measured=False)
            job = JobSpec(
                job_id="ckpt-job",
                model="digits_cnn",
                dataset="digits",
                batch_size=32,
                max_steps=40,
                checkpoint_every_steps=10,
                optimizer=OptimizerConfig(name="adam", lr=3e-3),
                state_readers=(client.peer_id,),
                assignment=(
                    (
                        StagePlacement(peer_id=peers[0].peer_id, first_layer=0, end_layer=2),
                        StagePlacement(peer_id=peers[1].peer_id, first_layer=2, end_layer=4),
                    ),
                ),
            )
            await client.publish_job(job)
            final = await client.wait_for_job(job, timeout_s=180, poll_s=0.5)

            # both stages announced their checkpoints (signed, under `checkpoints`): step 40 is complete
            async def complete_step():
                found = newest_complete(
                    await read_announcements(client.dht, job_id=job.job_id), job_id=job.job_id, num_layers=4
                )
                return found is not None and found[0] == 40

            await wait_until(complete_step, 30, message="checkpoint announcements of step 40")
            manifest_path = await client.checkpoint(tmp_path / "model.safetensors", job)

            # a client the job does not list is refused, and writes nothing
            async with await RunClient.connect(peers[0].maddrs, "ckpt") as stranger:
                with pytest.raises(RavnestError, match="not_allowed"):
                    await stranger.checkpoint(tmp_path / "stranger.safetensors", job)
            assert not (tmp_path / "stranger.safetensors").exists()

            # fine-tune: a new job starts from the checkpoint this client serves (peers dial it back)
            init = await client.serve_checkpoint(manifest_path)
            tuned = job.model_copy(
                update={
                    "job_id": "tuned",
                    "max_steps": 2,
                    "optimizer": OptimizerConfig(name="sgd", lr=1e-9),
                    "init_checkpoint": init,
                }
            )
            await client.publish_job(tuned)
            tuned_final = await client.wait_for_job(tuned, timeout_s=120, poll_s=0.5)
    finally:
        await close_all(peers)

    reported = next(m for m in final if m.stage == 0)
    assert reported.eval_accuracy is not None
    assert reported.eval_accuracy > 0.5  # it learned something worth checkpointing

    loaded_job, module, manifest = load_model(manifest_path.with_suffix(".safetensors"))
    assert loaded_job == job
    assert manifest.kind == "model"
    assert manifest.progress["optimizer_steps"] == 40
    # every parameter and buffer matches the digest its stage owner published
    state = module.state_dict()
    for m in final:
        for name, digest in (m.param_digests or {}).items():
            assert tensor_digest(state[name]) == digest, name
    assert any(n.startswith("optim/") for n in json.loads(manifest_path.read_text())["tensors"])

    loss, accuracy = evaluate_model(loaded_job, module)
    assert accuracy == reported.eval_accuracy
    assert reported.eval_loss is not None
    assert abs(loss - reported.eval_loss) <= 1e-5 * max(1.0, reported.eval_loss)
    torch.testing.assert_close(torch.tensor(loss), torch.tensor(reported.eval_loss))

    # two steps at lr 1e-9 from the checkpoint score what it scored (from scratch: ~10 %)
    tuned_first = next(m for m in tuned_final if m.stage == 0)
    assert tuned_first.eval_accuracy == pytest.approx(reported.eval_accuracy, abs=0.01)
