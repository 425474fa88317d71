"""Hostile fetch_state over real daemons: lying owners and prying strangers change nothing.

A hostile *owner* answers with forged manifests and pages (wrong digests, flipped bytes, truncated or
oversized pages, other dtypes or names, a moving version, NaNs, a huge announced shape); the receiving
stage must refuse every transfer and stay bit-identical. Hostile *requesters* (a stranger, forged page
requests, garbage bytes) get error replies; the owner's stage keeps training-state and serving.
"""

from __future__ import annotations

import resource

import pytest
import torch

from ravnest_p2p.errors import TransportError
from ravnest_p2p.training.handover import (
    FETCH_STATE,
    ExecutorSource,
    FetchStateRequest,
    FetchStateResponse,
    HandoverError,
    HandoverServer,
    ReadItem,
    fetch_state,
)
from ravnest_p2p.training.local import local_hosts
from ravnest_p2p.training.stage_state import (
    TensorEntry,
    capture_state,
    expected_entries,
    restore_state,
)
from ravnest_p2p.transport import RpcEndpoint
from ravnest_p2p.transport.wire import encode_envelope
from tests.unit.training.stage_state_helpers import build_split, resnet_job, train_step, union_state

pytestmark = pytest.mark.timeout(120)

_FORGERIES = [
    "manifest_digest",
    "flipped_byte",
    "truncated_page",
    "extra_elements",
    "other_dtype",
    "other_names",
    "moving_version",
    "nan_page",
    "huge_shape",
    "other_job",
]


def _rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _forge(kind: str, response: FetchStateResponse, tensors: list[torch.Tensor], calls: int):
    entries = list(response.entries)
    if kind == "manifest_digest" and entries:
        entries[0] = entries[0].model_copy(update={"digest": "0" * 16})
    if kind == "other_names" and entries:
        entries[0] = entries[0].model_copy(
            update={"name": "0.0.weight" if entries[0].name != "0.0.weight" else "1.conv1.weight"}
        )
    if kind == "huge_shape" and entries:
        entries[0] = entries[0].model_copy(update={"shape": (1 << 20, 1 << 20)})
    if kind == "other_dtype" and entries:
        entries[0] = entries[0].model_copy(update={"dtype": "float64"})
    update: dict[str, object] = {"entries": tuple(entries)}
    if kind == "moving_version" and response.read:
        update["version"] = f"{response.version}+{calls}"
    if kind == "other_job":
        update["job_id"] = "someone-else"
    tensors = [t.clone() for t in tensors]
    if tensors:
        if kind == "flipped_byte":
            tensors[0].view(torch.uint8)[0] ^= 1
        elif kind == "truncated_page":
            tensors[0] = tensors[0][:-1]
        elif kind == "extra_elements":
            tensors[0] = torch.cat([tensors[0], tensors[0][:1]])
        elif kind == "nan_page" and tensors[0].is_floating_point():
            tensors[0][0] = float("nan")
    return response.model_copy(update=update), tensors


async def test_a_lying_owner_never_changes_the_receiving_stage(hostile):
    hostile.surface = "rpc:fetch_state"
    job = resnet_job()
    [source] = build_split(job, [(0, 5)])
    train_step([source], 0)
    truth = capture_state(source)
    [target] = build_split(job, [(0, 5)])
    before = union_state([target])
    rss_before = _rss_bytes()
    async with local_hosts(2) as (owner_host, receiver_host):
        owner = RpcEndpoint(owner_host, "sec")
        honest = HandoverServer(owner)  # never started: the hostile handler below borrows its answers
        honest.publish(job.job_id, ExecutorSource(source), epoch=0, allowed={receiver_host.peer_id})
        mode = {"kind": "", "calls": 0}

        async def hostile_handler(request, tensors, context):
            mode["calls"] += 1
            result = await honest._handle(request, tensors, context)
            message, out = result if isinstance(result, tuple) else (result, [])
            return _forge(mode["kind"], message, list(out), mode["calls"])

        await owner.serve(FETCH_STATE, hostile_handler)
        receiver = RpcEndpoint(receiver_host, "sec")
        expected = expected_entries(target)
        for kind in _FORGERIES:
            mode["kind"], mode["calls"] = kind, 0
            hostile.sent += 1
            try:
                state = await fetch_state(
                    receiver,
                    owner_host.peer_id,
                    job.job_id,
                    layers=(0, 5),
                    expected=expected,
                    expected_digests={n: truth.digests[n] for n in list(truth.digests)[:3]},
                    page_bytes=16 << 10,
                    timeout_s=30,
                )
            except HandoverError:
                hostile.refused += 1
                continue
            except Exception:
                hostile.crashes += 1
                raise
            hostile.forged_accepted += 1
            restore_state(target, state)
            pytest.fail(f"forgery {kind!r} was accepted")
        # the same owner, honest, still works: the checks refuse forgeries, not transfers
        mode["kind"] = ""
        state = await fetch_state(receiver, owner_host.peer_id, job.job_id, layers=(0, 5), expected=expected)
        assert state.digests == truth.digests
    after = union_state([target])
    hostile.state_changes += sum(not torch.equal(before[n], after[n]) for n in before)
    hostile.peak_rss_growth_bytes = max(0, _rss_bytes() - rss_before)
    assert hostile.refused == len(_FORGERIES)
    assert hostile.state_changes == 0
    assert hostile.peak_rss_growth_bytes < 256 << 20  # the 8 TiB "huge_shape" was never allocated


async def test_strangers_and_forged_requests_are_refused_and_the_owner_keeps_serving(hostile):
    hostile.surface = "rpc:fetch_state"
    job = resnet_job()
    [stage] = build_split(job, [(0, 5)])
    train_step([stage], 0)
    truth = capture_state(stage)
    async with local_hosts(3) as (owner_host, member_host, stranger_host):
        owner = RpcEndpoint(owner_host, "sec")
        server = HandoverServer.of(owner)
        await server.start()
        server.publish(job.job_id, ExecutorSource(stage), epoch=0, allowed={member_host.peer_id})
        stranger = RpcEndpoint(stranger_host, "sec")
        member = RpcEndpoint(member_host, "sec")
        name = "1.conv1.weight"
        numel = truth.tensors[name].numel()
        forged = [
            (stranger, FetchStateRequest(job_id=job.job_id, layers=(0, 5))),
            (stranger, FetchStateRequest(job_id=job.job_id, read=(ReadItem(name=name, start=0, count=1),))),
            (member, FetchStateRequest(job_id=job.job_id, read=(ReadItem(name=name, start=numel, count=1),))),
            (
                member,
                FetchStateRequest(job_id=job.job_id, read=(ReadItem(name=name, start=0, count=1 << 30),)),
            ),
            (member, FetchStateRequest(job_id=job.job_id, read=(ReadItem(name="9.nope", start=0, count=1),))),
            (member, FetchStateRequest(job_id=job.job_id, names=("../../etc/passwd",))),
            (
                member,
                FetchStateRequest(
                    job_id=job.job_id, layers=(0, 5), read=(ReadItem(name=name, start=0, count=1),)
                ),
            ),
            (member, FetchStateRequest(job_id="other", layers=(0, 5))),
        ]
        for caller, request in forged:
            hostile.sent += 1
            try:
                await caller.call(owner_host.peer_id, FETCH_STATE, request, timeout_s=20)
            except TransportError:
                hostile.refused += 1
                continue
            hostile.forged_accepted += 1
        traversal = encode_envelope(
            {
                "kind": "request",
                "body": {
                    "job_id": "../../etc",
                    "layers": [0, 5],
                    "checkpoint": {"step": 1, "first_layer": 0, "end_layer": 5},
                },
            }
        )
        for garbage in (b"", b"RV1\xff\xff\xff\xff", b"\x00" * 1000, traversal):
            hostile.sent += 1
            reply = await stranger_host.call(
                owner_host.peer_id,
                f"ravnest/sec/{FETCH_STATE.name}",
                garbage,
                stream=True,
                max_response_bytes=1 << 20,
            )
            hostile.refused += int(b"error" in bytes(reply))
        # the member still gets the true state; the stage is untouched
        state = await fetch_state(member, owner_host.peer_id, job.job_id, layers=(0, 5), timeout_s=30)
        assert state.digests == truth.digests
    hostile.state_changes += int(capture_state(stage).digests != truth.digests)
    assert hostile.refused == hostile.sent
    assert hostile.forged_accepted == 0
    assert hostile.state_changes == 0


def test_entries_refuse_negative_and_oversized_shapes():
    with pytest.raises(ValueError, match="at most 8"):
        TensorEntry(name="0.w", dtype="float32", shape=(1,) * 9)
