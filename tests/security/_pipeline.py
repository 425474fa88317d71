"""A real 3-stage pipeline (real p2p daemons on loopback) plus an outsider, for the hostile-input tests."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel

from ravnest_p2p.errors import RemoteError, TransportError
from ravnest_p2p.models import get_model_spec, parse_config
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.runtime.service import PipelineConfig, StageService
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.local import even_split, local_hosts
from ravnest_p2p.training.stages import build_stage, load_dataset, num_layers, train_batches
from ravnest_p2p.transport import RpcEndpoint, RpcMethod
from tests.security.conftest import HostileTally

JOB = JobSpec(
    model="digits_cnn",
    dataset="digits",
    batch_size=16,
    max_steps=12,
    seed=3,
    optimizer=OptimizerConfig(name="adam", lr=3e-3),
)
EPOCH = 1
NAMESPACE = "hostile"


@dataclass
class Pipeline:
    services: list[StageService]
    outsider: RpcEndpoint

    @property
    def rpcs(self) -> list[RpcEndpoint]:
        return [s.rpc for s in self.services]

    def ids(self) -> list[str]:
        return [s.rpc.peer_id for s in self.services]


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    train, _ = load_dataset(JOB)
    return list(train_batches(JOB, train, cluster_index=0, num_clusters=1))


def digest(service: StageService) -> str:
    """A digest of every parameter and buffer of a stage (compare before/after a hostile phase)."""
    h = hashlib.sha256()
    ex = service.executor
    for name, t in sorted({**ex.parameters_by_name(), **ex.buffers_by_name()}.items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@contextlib.asynccontextmanager
async def hostile_pipeline(*, threshold: int = 40, **knobs: Any) -> AsyncIterator[Pipeline]:
    """Stages 0..2 on three real hosts and a fourth host as the outsider; middle stages know the labels."""
    spec = get_model_spec(JOB.model)
    label_spec = spec.label_spec(parse_config(JOB.model, JOB.model_params))
    async with local_hosts(4) as transports:
        stage_hosts, outsider = transports[:3], transports[3]
        peers = [t.peer_id for t in stage_hosts]
        services: list[StageService] = []
        try:
            for i, (t, (first, end)) in enumerate(
                zip(stage_hosts, even_split(num_layers(JOB), 3), strict=True)
            ):
                service = StageService(
                    RpcEndpoint(t, NAMESPACE),
                    build_stage(JOB, first, end, max_in_flight=3),
                    epoch=EPOCH,
                    cluster_peers=peers,
                    stage_index=i,
                    config=PipelineConfig(
                        max_in_flight=3, micro_batch_timeout_s=120, misbehaviour_threshold=threshold, **knobs
                    ),
                    label_spec=label_spec,
                )
                await service.start()
                services.append(service)
            yield Pipeline(services, RpcEndpoint(outsider, NAMESPACE))
        finally:
            for service in services:
                await service.aclose()


async def send(
    tally: HostileTally,
    rpc: RpcEndpoint,
    peer: str,
    method: RpcMethod[Any, Any],
    request: BaseModel,
    tensors: Sequence[torch.Tensor] = (),
) -> str:
    """Send one hostile message; count it; return "ok" or the refusal's code."""
    tally.sent += 1
    try:
        await rpc.call(peer, method, request, tensors=tensors, timeout_s=20)
        return "ok"
    except RemoteError as exc:
        tally.refused += 1
        if exc.code == "internal":
            tally.crashes += 1
        return exc.code
    except TransportError as exc:
        return f"transport: {exc}"


def settle(tally: HostileTally, pipeline: Pipeline, before: Sequence[str] | None = None) -> None:
    """Fill the failure and state-change counters (digests compared when ``before`` is given)."""
    tally.stage_failures += sum(s.failure is not None for s in pipeline.services)
    if before is not None:
        tally.state_changes += sum(a != digest(s) for a, s in zip(before, pipeline.services, strict=True))
