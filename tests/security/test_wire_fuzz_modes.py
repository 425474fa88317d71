"""The envelope fuzzer (`test_wire_fuzz`) against the training modes' handlers, on real p2p daemons.

`sync_push` / `sync_ping` (a sync_backup shard owner) and `ist_pull` (an IST worker's holder side) are
served only while a job of that mode runs, so the generic fuzz targets (a peer, a pipeline, a ring) never
reach them. Here two workers serve them for real jobs; a stranger sends each method random, truncated,
oversized and mistyped envelopes over both the unary and the stream path. Every message must be refused
(never ``internal``, never garbled), and nothing may change: the shard owners' parameters and steps, the
IST worker's model tensors and rounds.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import pytest

from ravnest_p2p.errors import TransportError
from ravnest_p2p.training.ist_runner import IstRunner
from ravnest_p2p.training.ist_wire import IST_PULL
from ravnest_p2p.training.role import role_for
from ravnest_p2p.training.sync_runner import SyncBackupRunner
from ravnest_p2p.transport import RpcEndpoint
from tests.security._wire_support import hosts
from tests.security.test_wire_fuzz import _verdict, hostile_message
from tests.unit.training import test_ist_network, test_sync_backup

pytestmark = pytest.mark.timeout(300)

MODE_METHODS = {"sync_push", "sync_ping", "ist_pull"}


def _state(sync: SyncBackupRunner, ist: IstRunner) -> str:
    h = hashlib.sha256()
    for shard, owner in sorted(sync.owners.owned.items()):
        h.update(repr((shard, owner.step, owner.num_pending)).encode())
        for name, value in sorted(owner.params.items()):
            h.update(name.encode() + value.detach().numpy().tobytes())
    state = ist.state
    h.update(repr((state.committed, sorted(state.dead_since.items()), state.evicted)).encode())
    for tensor in [*state.tensors.dealt, *state.tensors.shared]:
        h.update(tensor.detach().numpy().tobytes())
    return h.hexdigest()


async def _fuzz(hostile: Any, per_method: int, seed: int) -> None:
    hostile.surface = "rpc:modes"
    rng = random.Random(seed)
    async with hosts(3) as (sync_host, ist_host, attacker):
        workers = [sync_host.peer_id, ist_host.peer_id]
        sync_job = test_sync_backup._job(workers, n=2, b=0, max_steps=4)
        ist_job = test_ist_network._job(workers, max_steps=6)
        sync_role, ist_role = role_for(sync_job, None, workers[0]), role_for(ist_job, None, workers[1])
        assert sync_role is not None
        assert ist_role is not None
        sync = SyncBackupRunner(RpcEndpoint(sync_host, "run"), None, sync_job, sync_role)
        ist = IstRunner(RpcEndpoint(ist_host, "run"), None, ist_job, ist_role)
        await sync.owners.serve()
        await ist.rpc.serve(IST_PULL, ist.state.handle_pull)
        try:
            targets = [
                (endpoint.peer_id, method)
                for endpoint in (sync.rpc, ist.rpc)
                for method in endpoint.served.values()
                if method.name in MODE_METHODS
            ]
            assert {method.name for _, method in targets} == MODE_METHODS
            before = _state(sync, ist)
            outcomes: dict[str, int] = {}
            for peer_id, method in targets:
                for _ in range(per_method):
                    kind, data = hostile_message(method, rng)
                    stream = rng.random() < 0.25 or len(data) > (2 << 20)
                    hostile.sent += 1
                    try:
                        reply = await attacker.call(
                            peer_id,
                            f"ravnest/run/{method.name}",
                            data,
                            stream=stream,
                            max_response_bytes=64 << 20,
                        )
                        verdict = _verdict(bytes(reply))
                    except TransportError:
                        verdict = "no_reply"
                    outcomes[verdict] = outcomes.get(verdict, 0) + 1
                    assert verdict not in ("internal", "garbled", "response"), (method.name, kind, verdict)
                    hostile.refused += verdict == "refused"
            after = _state(sync, ist)
            hostile.state_changes += after != before
            assert after == before
            assert outcomes.get("no_reply", 0) < 0.05 * hostile.sent, outcomes
        finally:
            await sync.owners.aclose()
            await ist.rpc.unserve(IST_PULL)


async def test_mode_handlers_survive_hostile_envelopes(hostile: Any) -> None:
    await _fuzz(hostile, per_method=40, seed=3)
    assert hostile.sent >= 120


@pytest.mark.slow
async def test_mode_handlers_survive_many_hostile_envelopes(hostile: Any) -> None:
    await _fuzz(hostile, per_method=400, seed=4)
    assert hostile.sent >= 1200
