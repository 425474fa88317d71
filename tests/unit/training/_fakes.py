"""In-memory doubles for the job supervisor's seams: a signed-subkey DHT, a plan source, runners."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import torch

from ravnest_p2p.planning import ClusterPlan, JobParams, Plan, StageAssignment
from ravnest_p2p.training.resume import HeldState
from ravnest_p2p.training.role import StageRole
from ravnest_p2p.training.stage_state import StageState, tensor_digest


class FakeDHT:
    """A dict-backed stand-in for `discovery.RunDHT`: each handle writes only its own signer's subkey.

    Values go through JSON (as the real one goes through msgpack), so nothing shares objects.
    """

    def __init__(self, signer: str = "me", store: dict[str, dict[str, tuple[Any, float]]] | None = None):
        self.signer = signer
        self.store: dict[str, dict[str, tuple[Any, float]]] = store if store is not None else {}
        self.writes: list[tuple[str, str]] = []
        self.pins: list[tuple[str, str]] = []  # (signer, name) of the writes also pinned at the initial peers
        self.run_owner: str | None = None

    def as_signer(self, signer: str) -> FakeDHT:
        """A handle on the same store that signs as `signer` (another peer, the job's owner)."""
        return FakeDHT(signer, self.store)

    async def store_own(
        self, name: str, value: Any, *, ttl_s: float, pin_to_initial_peers: bool = False
    ) -> bool:
        self.store.setdefault(name, {})[self.signer] = (json.loads(json.dumps(value)), time.time() + ttl_s)
        self.writes.append((self.signer, name))
        if pin_to_initial_peers:
            self.pins.append((self.signer, name))
        return True

    async def get_signed(
        self, name: str, *, from_initial_peers: bool = False
    ) -> dict[str, tuple[Any, float]]:
        now = time.time()
        return {
            s: (json.loads(json.dumps(v)), e) for s, (v, e) in self.store.get(name, {}).items() if e > now
        }


class FakePlans:
    """The membership as the supervisor sees it: tests set `active_plan` and `active_workload`."""

    def __init__(self) -> None:
        self.active_plan: Plan | None = None
        self.active_workload: str | None = None
        self.workloads: list[str] = []
        self.serving: list[Any] = []

    def set_workload(self, key: str, job: JobParams, layers: list[Any], *, serving: Any = None) -> None:
        self.workloads.append(key)
        self.serving.append(serving)


def make_plan(epoch: int, *clusters: list[tuple[str, int, int]]) -> Plan:
    """A plan from clusters of (peer, first_layer, end_layer)."""
    return Plan(
        epoch=epoch,
        clusters=tuple(
            ClusterPlan(
                index=i,
                stages=tuple(
                    StageAssignment(
                        peer_id=p, first_layer=f, last_layer_exclusive=e, stage_time_s=0.0, memory_bytes=0
                    )
                    for p, f, e in cluster
                ),
                bottleneck_s=0.0,
            )
            for i, cluster in enumerate(clusters)
        ),
    )


def layer_tensors(tag: float, first: int, end: int) -> dict[str, torch.Tensor]:
    return {f"{layer}.weight": torch.full((2,), tag + layer) for layer in range(first, end)}


def layer_state(tag: float, first: int, end: int) -> StageState:
    tensors = layer_tensors(tag, first, end)
    return StageState(tensors=tensors, digests={n: tensor_digest(t) for n, t in tensors.items()})


class FakeRun:
    """A runner that trains nothing: it runs until told to finish (or fail), then holds a state."""

    def __init__(self, role: StageRole, state: StageState | None, *, tag: float) -> None:
        self.role = role
        self.initial_state = state
        self.tag = tag
        self.stop_requested = asyncio.Event()
        self.held_state: HeldState | None = None
        self.started = asyncio.Event()
        self.finish = asyncio.Event()
        self.fail: BaseException | None = None
        self.cancelled = False

    async def run(self) -> str:
        self.started.set()
        try:
            stop = asyncio.ensure_future(self.stop_requested.wait())
            finish = asyncio.ensure_future(self.finish.wait())
            try:
                await asyncio.wait({stop, finish}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                finish.cancel()
            if self.fail is not None:
                raise self.fail
            return "done"
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            first, end = self.role.first_layer, self.role.end_layer
            self.held_state = HeldState(first, end, layer_state(self.tag, first, end))


class FakeRunners:
    """The runner factory: records every runner it made."""

    def __init__(self, *, tag: float = 100.0) -> None:
        self.made: list[FakeRun] = []
        self.tag = tag

    def __call__(self, job: Any, role: StageRole, state: StageState | None) -> FakeRun:
        run = FakeRun(role, state, tag=self.tag)
        self.made.append(run)
        return run


class FakeStateSource:
    """Answers hand-over fetches from a table {peer: tag}; records every call."""

    def __init__(
        self,
        tags: dict[str, float],
        *,
        checkpoint_tag: float | None = None,
        held_epochs: dict[str, set[int]] | None = None,
    ) -> None:
        self.tags = tags
        # {peer: plan epochs it served}; a peer not named serves every epoch; `epoch` None: its newest
        self.held_epochs = held_epochs or {}
        self.checkpoint_tag = checkpoint_tag
        self.calls: list[tuple[str, int, int, frozenset[str]]] = []
        self.epochs: list[int | None] = []
        self.checkpoint_calls: list[tuple[int, int]] = []
        self.checkpoint_queries: list[Any] = []
        self.shared: list[tuple[str, frozenset[str]]] = []
        self.announced: list[str] = []  # job ids whose disk checkpoints were announced

    async def share_checkpoints(self, job_id: str, peer_ids: frozenset[str]) -> None:
        self.shared.append((job_id, peer_ids))

    async def announce_checkpoints(self, job: Any) -> None:
        self.announced.append(job.job_id)

    async def fetch(
        self,
        peer_id: str,
        *,
        job_id: str,
        epoch: int | None,
        first_layer: int,
        end_layer: int,
        allowed: frozenset[str],
    ) -> StageState | None:
        self.calls.append((peer_id, first_layer, end_layer, allowed))
        self.epochs.append(epoch)
        if peer_id not in self.tags:
            return None
        if epoch is not None and epoch not in self.held_epochs.get(peer_id, {epoch}):
            return None
        return layer_state(self.tags[peer_id], first_layer, end_layer)

    async def from_checkpoint(self, query: Any, *, first_layer: int, end_layer: int) -> StageState | None:
        self.checkpoint_calls.append((first_layer, end_layer))
        self.checkpoint_queries.append(query)
        if self.checkpoint_tag is None:
            return None
        return layer_state(self.checkpoint_tag, first_layer, end_layer)


class FakeClientDHT(FakeDHT):
    """A `FakeDHT` with the `transport.peer_id` a `RunClient` reads (its own signing identity)."""

    @property
    def transport(self) -> Any:
        return type("T", (), {"peer_id": self.signer})()
