"""An outsider that attacks a running job's peers: a bounded flood and a slowloris, each stopping by itself.

The outsider is its own host (`P2PTransport`), in no job. The flood sends, to every method each target
serves (enumerated from `RpcEndpoint.served`, so stage RPCs appear once the job runs), random and
malformed envelopes, plus well-formed requests a stage must refuse from a stranger (forwards, backwards,
eval results, finishes, oversized probes). The slowloris holds half-open streams that announce the
largest frame a method takes and trickle a few bytes at a time. Both are bounded by counts and a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ravnest_p2p.errors import RemoteError, TransportError
from ravnest_p2p.measurement.network import PROBE, ProbeRequest
from ravnest_p2p.runtime.messages import (
    BACKWARD,
    EVAL_RESULT,
    FINISH,
    FORWARD,
    MAX_ACTIVATION_BYTES,
    BackwardRequest,
    EvalResult,
    FinishRequest,
    ForwardRequest,
)
from ravnest_p2p.transport import P2PTransport, RpcEndpoint, RpcMethod
from ravnest_p2p.transport.limits import MAX_PROBE_BYTES
from ravnest_p2p.transport.wire import decode_envelope
from tests.security._wire_support import FRAME_LEN, close_all, open_raw
from tests.security.test_wire_fuzz import hostile_message

_CALL_TIMEOUT_S = 10.0  # one outsider call, stream open or drain


@dataclass
class AttackCounts:
    """What the outsider sent and how the peers answered (`by_code`: refusal codes and verdicts)."""

    sent: int = 0
    refused: int = 0
    crashes: int = 0  # `internal` replies: a handler failed on the outsider's message
    accepted: int = 0  # well-formed stage requests a peer acted on (must stay 0)
    streams: int = 0  # slowloris streams opened
    by_code: dict[str, int] = field(default_factory=dict)

    def note(self, code: str) -> None:
        self.by_code[code] = self.by_code.get(code, 0) + 1


@dataclass(frozen=True)
class Target:
    peer_id: str
    namespace: str
    methods: dict[str, RpcMethod[Any, Any]]  # what it serves when the attack starts (`RpcEndpoint.served`)
    # whether it still serves a method now (None: unknown): a call that got no reply from a peer that
    # has since stopped serving that method (its job ended) is `stopped`, not a dropped request
    serving: Callable[[str], bool] | None = None

    def stopped(self, method: str) -> bool:
        return self.serving is not None and not self.serving(method)


def _verdict(reply: bytes) -> str:
    try:
        envelope = decode_envelope(reply, max_bytes=64 << 20)
    except Exception:  # a reply we cannot read is a finding, not a refusal
        return "garbled"
    kind = envelope.header.get("kind")
    if kind == "error":
        return "internal" if envelope.header.get("code") == "internal" else "junk_refused"
    return "junk_answered" if kind == "response" else "garbled"


def _over(deadline: float, stop: asyncio.Event) -> bool:
    return stop.is_set() or time.monotonic() > deadline


async def flood(
    outsider: P2PTransport,
    targets: Sequence[Target],
    counts: AttackCounts,
    *,
    rounds: int,
    deadline: float,
    stop: asyncio.Event,
    senders: int = 4,
) -> None:
    """`senders` concurrent loops of `rounds` passes over every target's methods: junk envelopes, then
    refused well-formed requests. Ends after the rounds, at `deadline` or when `stop` is set."""
    await asyncio.gather(
        *(_flood(outsider, targets, counts, rounds, deadline, stop, seed) for seed in range(senders))
    )


async def _flood(
    outsider: P2PTransport,
    targets: Sequence[Target],
    counts: AttackCounts,
    rounds: int,
    deadline: float,
    stop: asyncio.Event,
    seed: int,
) -> None:
    rng = random.Random(seed)
    endpoint = RpcEndpoint(outsider, targets[0].namespace)
    for round_index in range(rounds):
        for target in targets:
            for name, method in target.methods.items():
                if _over(deadline, stop):
                    return
                _, data = hostile_message(method, rng)
                counts.sent += 1
                try:
                    # bounded: a call whose handler went away as the job ended was seen never to return
                    # (the attack then outlived its 75 s budget in a default-suite run)
                    async with asyncio.timeout(_CALL_TIMEOUT_S):
                        reply = await outsider.call(
                            target.peer_id,
                            f"ravnest/{target.namespace}/{name}",
                            data,
                            stream=len(data) > (1 << 20),  # past the unary cap: the stream path refuses it
                            max_response_bytes=1 << 20,
                        )
                except (TransportError, TimeoutError):
                    counts.note("no_reply")
                    continue
                verdict = _verdict(bytes(reply))  # "junk_answered": e.g. a ping with a harmless body
                counts.note(verdict)
                counts.refused += verdict == "junk_refused"
                counts.crashes += verdict in ("internal", "garbled")
            await _well_formed(endpoint, target, counts, round_index, deadline, stop)


async def _well_formed(
    endpoint: RpcEndpoint,
    target: Target,
    counts: AttackCounts,
    round_index: int,
    deadline: float,
    stop: asyncio.Event,
) -> None:
    x = torch.randn(16, 1, 8, 8)
    y = torch.randint(0, 10, (16,))
    calls = [
        (
            FORWARD,
            ForwardRequest(epoch=round_index % 3, micro_batch_id=round_index, weight_version=0),
            [x, y],
        ),
        (BACKWARD, BackwardRequest(epoch=round_index % 3, micro_batch_id=round_index), [torch.randn(16, 10)]),
        (
            EVAL_RESULT,
            EvalResult(
                epoch=round_index % 3,
                micro_batch_id=round_index,
                loss_sum=1.0,
                num_correct=16,
                num_samples=16,
                num_targets=16,
            ),
            [],
        ),
        (FINISH, FinishRequest(epoch=round_index % 3), []),
    ]
    for method, request, tensors in calls:
        if method.name not in target.methods or _over(deadline, stop):
            continue
        counts.sent += 1
        try:
            await endpoint.call(target.peer_id, method, request, tensors=tensors, timeout_s=10)
            counts.accepted += 1
            counts.note(f"{method.name}:accepted")
        except RemoteError as exc:
            counts.refused += 1
            counts.crashes += exc.code == "internal"
            counts.note(f"{method.name}:{exc.code}")
        except TransportError:
            counts.note(f"{method.name}:{'stopped' if target.stopped(method.name) else 'no_reply'}")
    if PROBE.name in target.methods and not _over(deadline, stop):
        # a probe asking for more than the cap: refused by the wire's size check (a `ProbeRequest`
        # bypassing its own validation, as a stranger's encoder would)
        counts.sent += 1
        try:
            await endpoint.call(
                target.peer_id,
                PROBE,
                ProbeRequest.model_construct(download_bytes=MAX_PROBE_BYTES * 64),
                timeout_s=10,
            )
            counts.note("probe:answered")
        except RemoteError as exc:
            counts.refused += 1
            counts.crashes += exc.code == "internal"
            counts.note(f"probe:{exc.code}")
        except TransportError:
            counts.note("probe:no_reply")


async def slowloris(
    outsider: P2PTransport,
    targets: Sequence[Target],
    counts: AttackCounts,
    *,
    streams_per_target: int,
    trickle_s: float,
    stop: asyncio.Event,
) -> None:
    """Half-open streams to every target's forward and probe stream handlers, trickling 64 B every 0.2 s
    for `trickle_s` or until `stop` is set."""
    rng = random.Random(9)
    writers: list[asyncio.StreamWriter] = []
    sizes = {"forward": MAX_ACTIVATION_BYTES, "probe_bandwidth": MAX_PROBE_BYTES}
    try:
        for target in targets:
            for i in range(streams_per_target):
                name = "forward" if i % 2 == 0 and "forward" in target.methods else "probe_bandwidth"
                try:
                    async with asyncio.timeout(_CALL_TIMEOUT_S):
                        _, writer = await open_raw(
                            outsider, target.peer_id, f"ravnest/{target.namespace}/{name}/stream"
                        )
                except Exception:  # a refused stream is the point (or one never opened)
                    counts.note("stream_refused")
                    counts.refused += 1
                    continue
                writer.write(FRAME_LEN.pack(sizes[name]))
                writers.append(writer)
                counts.streams += 1
                counts.sent += 1
        end = time.monotonic() + trickle_s
        while time.monotonic() < end and writers and not stop.is_set():
            for writer in list(writers):
                try:
                    writer.write(rng.randbytes(64))
                    async with asyncio.timeout(_CALL_TIMEOUT_S):
                        await writer.drain()
                except (ConnectionError, OSError, TimeoutError):
                    writers.remove(writer)  # closed by the peer's idle deadline or budget
                    counts.note("stream_closed")
                    counts.refused += 1
            await asyncio.sleep(0.2)
    finally:
        close_all(writers)
        with contextlib.suppress(Exception):
            await asyncio.sleep(0)
