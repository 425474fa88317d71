"""The asynchronous pipeline over real p2p daemons: exactness, learning, and refusal of bad messages."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ravnest_p2p.errors import RemoteError
from ravnest_p2p.runtime.messages import BACKWARD, FORWARD, BackwardRequest, ForwardRequest
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.local import local_hosts, local_pipeline
from ravnest_p2p.training.stages import build_stage, load_dataset, num_layers, train_batches

pytestmark = pytest.mark.timeout(240)


JOB = JobSpec(
    model="digits_cnn",
    dataset="digits",
    batch_size=16,
    max_steps=12,
    seed=3,
    optimizer=OptimizerConfig(name="adam", lr=3e-3),
)


async def test_three_stage_pipeline_with_one_in_flight_equals_single_process_training():
    train, _ = load_dataset(JOB)
    single = build_stage(JOB, 0, num_layers(JOB), max_in_flight=1)
    for mb, (x, y) in enumerate(train_batches(JOB, train, cluster_index=0, num_clusters=1)):
        single.forward_loss(mb, x, y)
    async with local_hosts(3) as transports, local_pipeline(JOB, transports, max_in_flight=1) as services:
        stats = await services[0].train(train_batches(JOB, train, cluster_index=0, num_clusters=1))
        assert stats.completed == 12
        distributed = {}
        for service in services:
            distributed.update({n: p.detach() for n, p in service.executor.parameters_by_name().items()})
    expected = {n: p.detach() for n, p in single.parameters_by_name().items()}
    assert set(distributed) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(distributed[name], value, atol=1e-5, rtol=0, msg=name)
    # and training really moved the weights
    fresh = build_stage(JOB, 0, num_layers(JOB), max_in_flight=1).parameters_by_name()
    assert any(not torch.allclose(fresh[n], expected[n]) for n in expected)


async def test_async_pipeline_learns_digits_and_evaluates():
    job = JOB.model_copy(update={"max_steps": None, "num_epochs": 3, "batch_size": 32})
    train, test = load_dataset(job)
    async with local_hosts(3) as transports, local_pipeline(job, transports, max_in_flight=3) as services:
        first = services[0]
        await first.train(train_batches(job, train, cluster_index=0, num_clusters=1))
        loss, accuracy = await first.evaluate([(test.inputs, test.labels)])
        await first.finish()
        assert all(s.finished.is_set() for s in services)
        assert all(s.failure is None for s in services)
        # every stage stepped its optimizer; the stash was released
        assert all(s.executor.num_steps == first.stats.completed for s in services)
        assert all(not s.executor.in_flight for s in services)
    assert accuracy >= 0.93, (loss, accuracy)


async def test_bad_messages_are_refused_and_change_no_state():
    train, _ = load_dataset(JOB)
    async with local_hosts(3) as transports, local_pipeline(JOB, transports, max_in_flight=2) as services:
        x, y = next(iter(train_batches(JOB, train, cluster_index=0, num_clusters=1)))
        middle = services[1]
        before = {n: p.detach().clone() for n, p in middle.executor.parameters_by_name().items()}
        rpc_as_first = services[0].rpc
        good_act = await asyncio.to_thread(services[0].executor.predict, x)

        async def refused(method, request, tensors, code, rpc=rpc_as_first, peer=middle.rpc.peer_id):
            with pytest.raises(RemoteError) as err:
                await rpc.call(peer, method, request, tensors=tensors, timeout_s=20)
            assert err.value.code == code, err.value

        ok = ForwardRequest(epoch=1, micro_batch_id=99, weight_version=0)
        await refused(FORWARD, ok.model_copy(update={"epoch": 7}), [good_act, y], "stale_epoch")
        await refused(FORWARD, ok, [good_act[:, :3], y], "invalid_message")  # wrong shape
        await refused(FORWARD, ok, [good_act.double(), y], "invalid_message")  # wrong dtype
        await refused(FORWARD, ok, [good_act], "invalid_message")  # labels missing
        bad = good_act.clone()
        bad[0, 0] = float("nan")
        await refused(FORWARD, ok, [bad, y], "codec_error")  # non-finite
        await refused(FORWARD, ok, [torch.zeros(70_000_000), y], "payload_too_large")
        # backward for a micro-batch the middle stage never saw
        back = BackwardRequest(epoch=1, micro_batch_id=12345)
        await refused(
            BACKWARD, back, [good_act], "invalid_message", rpc=services[2].rpc, peer=middle.rpc.peer_id
        )
        # a forward from a peer that is not the previous stage
        await refused(FORWARD, ok, [good_act, y], "invalid_message", rpc=services[2].rpc)
        assert middle.executor.in_flight == ()
        assert middle.executor.weight_version == 0
        for name, value in middle.executor.parameters_by_name().items():
            assert torch.equal(value.detach(), before[name])
        # and the pipeline still trains afterwards
        stats = await services[0].train(train_batches(JOB, train, cluster_index=0, num_clusters=1))
        assert stats.completed == 12
