"""Pseudo-gradient codecs, error feedback, the outer step (Nesterov SGD), state export/import.

Asserts use torch.allclose: the first torch.testing.assert_close imports for seconds on a busy host.
"""

import pytest
import torch

from ravnest_p2p.averaging import DeltaCompression, OuterOptimizer, OuterOptimizerConfig
from ravnest_p2p.averaging.pseudograd import compress, encoded_bytes
from ravnest_p2p.training.job import JobSpec


def test_quantisers_stay_within_half_a_step_of_each_chunks_scale():
    value = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 1000)
    for method, levels in ((DeltaCompression.INT8, 127), (DeltaCompression.INT4, 7)):
        decoded, nbytes = compress(value, method, chunk_numel=100)
        chunks, errors = value.reshape(10, 100), (decoded - value).reshape(10, 100)
        scale = chunks.abs().amax(1, keepdim=True) / levels
        assert bool((errors.abs() <= scale / 2 + 1e-6).all())
        assert nbytes == encoded_bytes(1000, method, chunk_numel=100)
    assert encoded_bytes(1000, DeltaCompression.INT8, chunk_numel=100) == 1000 + 40
    assert encoded_bytes(1001, DeltaCompression.INT4, chunk_numel=100) == 501 + 44
    zeros, _ = compress(torch.zeros(7), DeltaCompression.INT4, chunk_numel=4)
    assert torch.equal(zeros, torch.zeros(7))


def test_topk_keeps_the_largest_entries():
    value = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 1.0, 0.05, 0.0, 0.0])
    decoded, nbytes = compress(value, DeltaCompression.TOPK, topk_fraction=0.2)
    assert torch.equal(decoded, torch.tensor([0, -5.0, 0, 3.0, 0, 0, 0, 0, 0, 0]))
    assert nbytes == 2 * 8
    with pytest.raises(ValueError, match="topk_fraction"):
        compress(value, DeltaCompression.TOPK, topk_fraction=0)


SPARSE = {"compression": DeltaCompression.TOPK, "topk_fraction": 0.1, "topk_chunk": 16, "topk_bits": 2}


@pytest.mark.parametrize(
    "codec",
    [
        {"compression": DeltaCompression.INT4, "chunk_numel": 16},
        {"compression": DeltaCompression.TOPK, "topk_fraction": 0.05},
        pytest.param(SPARSE, id="sparse"),  # SparseLoCo's chunked 2-bit top-k
        pytest.param({**SPARSE, "local_momentum": True}, id="sparse-local-momentum"),
    ],
)
def test_error_feedback_loses_nothing_for_good(codec):
    # what was sent over all syncs + the final residual = what was to be sent (momentum 0: Δ itself)
    outer = OuterOptimizer(OuterOptimizerConfig(lr=1.0, momentum=0.0, **codec))
    outer.initialise({"w": torch.zeros(64)})
    gen = torch.Generator().manual_seed(1)
    total_delta, total_sent = torch.zeros(64), torch.zeros(64)
    for _ in range(6):
        local = outer.theta["w"] - torch.randn(64, generator=gen)
        total_delta += outer.theta["w"] - local
        proposal = outer.outgoing({"w": local})["w"]
        total_sent += outer.theta["w"] - proposal
        outer.step({"w": proposal})  # alone in its "ring": the mean is its own proposal
    assert torch.allclose(total_sent + outer.residual["w"], total_delta, atol=1e-5, rtol=0)


def test_outer_step_is_sgd_with_nesterov_momentum():
    # torch.optim.SGD(nesterov=True)'s update, in float64 (torch's optimizer imports dynamo: seconds)
    outer = OuterOptimizer(OuterOptimizerConfig(lr=0.7, momentum=0.9))
    start = torch.randn(32, generator=torch.Generator().manual_seed(2))
    outer.initialise({"w": start})
    theta, buf = start.double(), torch.zeros(32, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        mean = outer.theta["w"] - 0.1 * torch.randn(32, generator=gen)  # the replicas' average P̄
        grad = theta - mean.double()  # Δ̄ = θ_outer - P̄
        buf = 0.9 * buf + grad
        theta = theta - 0.7 * (grad + 0.9 * buf)
        outer.outgoing({"w": mean})
        new = outer.step({"w": mean})["w"]
        assert torch.allclose(new.double(), theta, atol=1e-5, rtol=1e-5)


def test_a_shard_that_was_not_averaged_takes_no_step():
    outer = OuterOptimizer(OuterOptimizerConfig(compression=DeltaCompression.INT8))
    outer.initialise({"w": torch.ones(8), "b": torch.ones(2)})
    outer.outgoing({"w": torch.zeros(8), "b": torch.zeros(2)})
    outer.step({"b": torch.full((2,), 0.5)})  # w's ring ran alone this round
    state = outer.export_state()
    assert torch.equal(outer.theta["w"], torch.ones(8))
    assert "w" not in outer.momentum
    assert "w" not in outer.residual
    assert "outer/b/momentum" in state
    assert "outer/b/residual" in state


def test_state_moves_to_a_new_owner_by_name():
    outer = OuterOptimizer(OuterOptimizerConfig(compression=DeltaCompression.INT4))
    outer.initialise({"0.weight": torch.ones(4, 2), "1.bias": torch.ones(3)})
    proposals = outer.outgoing({"0.weight": torch.zeros(4, 2), "1.bias": torch.zeros(3)})
    outer.step(proposals)
    exported = outer.export_state(names={"1.bias"})
    assert set(exported) == {"outer/1.bias/theta", "outer/1.bias/momentum", "outer/1.bias/residual"}
    taker = OuterOptimizer(outer.config)
    taker.import_state(exported, shapes={"1.bias": torch.Size([3])})
    assert torch.equal(taker.theta["1.bias"], outer.theta["1.bias"])
    assert torch.equal(taker.momentum["1.bias"], outer.momentum["1.bias"])
    with pytest.raises(ValueError, match="not outer state"):
        taker.import_state(exported, shapes={"0.weight": torch.Size([4, 2])})
    with pytest.raises(ValueError, match="without an anchor"):
        taker.import_state({"outer/1.bias/momentum": torch.zeros(3)}, shapes={"1.bias": torch.Size([3])})
    with pytest.raises(ValueError, match="non-finite"):
        taker.import_state({"outer/1.bias/theta": torch.full((3,), float("nan"))}, shapes={"1.bias": (3,)})


def test_jobspec_outer_optimizer_needs_a_period_and_defaults_to_plain_averaging():
    assert JobSpec().outer_optimizer is None
    with pytest.raises(ValueError, match="needs averaging_period"):
        JobSpec(outer_optimizer=OuterOptimizerConfig())
    job = JobSpec.model_validate(
        {"averaging_period_steps": 50, "outer_optimizer": {"compression": "int8", "lr": 0.7}}
    )
    assert job.outer_optimizer is not None
    assert job.outer_optimizer.momentum == 0.9
    assert JobSpec.model_validate(job.to_wire()) == job
    with pytest.raises(ValueError, match="momentum"):
        OuterOptimizerConfig(momentum=1.0)
    with pytest.raises(ValueError, match="extra"):
        OuterOptimizerConfig.model_validate({"lr": 0.7, "typo": 1})
