"""Transport: a big tensor through our RPC path vs. the same bytes over a raw hivemind P2P stream.

Two `P2PTransport`s (two p2p daemons on loopback) in this process. Ours: `RpcEndpoint.call` of a method
whose request carries one uint8 tensor of S bytes (encode, envelope, framed stream, decode and checks on
the server, a small reply). Baseline: `P2P.call_binary_stream_handler` on the same two daemons, the
client writes the same S bytes in 1 MiB chunks and the server reads them and answers one byte. Both
sides share one event loop and 2 cores in both variants, so the ratio is per-byte overhead in Python
(copies, checks), which is what the codec path adds. Rounds alternate between the two variants.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import torch
from hivemind.p2p import PeerID
from pydantic import BaseModel

from benchmarks.harness import record
from ravnest_p2p.transport import HostConfig, P2PTransport, RpcEndpoint, RpcMethod, load_or_create_identity

_RAW = "bench/raw_sink"
_CHUNK = 1 << 20


class Sink(BaseModel):
    tag: int = 0


class SinkReply(BaseModel):
    received_bytes: int


def _method(size_bytes: int) -> RpcMethod[Sink, SinkReply]:
    return RpcMethod("bench_sink", Sink, SinkReply, max_request_bytes=size_bytes + (1 << 16), max_tensors=1)


async def _raw_handler(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    size = int.from_bytes(await reader.readexactly(8), "big")
    remaining = size
    while remaining:
        chunk = await reader.read(min(remaining, 4 * _CHUNK))
        if not chunk:
            break
        remaining -= len(chunk)
    writer.write(b"\x01")
    await writer.drain()
    writer.close()


async def _raw_send(client: P2PTransport, server_id: str, payload: memoryview) -> float:
    start = time.perf_counter()
    _, reader, writer = await client.p2p.call_binary_stream_handler(PeerID.from_base58(server_id), _RAW)
    writer.write(len(payload).to_bytes(8, "big"))
    for i in range(0, len(payload), _CHUNK):
        writer.write(payload[i : i + _CHUNK])
        await writer.drain()
    await reader.readexactly(1)
    writer.close()
    return time.perf_counter() - start


async def _measure(size_bytes: int, repeats: int) -> dict[str, Any]:
    hosts = [
        await P2PTransport.create(HostConfig(check_identity_free=False), load_or_create_identity(None))
        for _ in range(2)
    ]
    server, client = hosts
    try:
        method = _method(size_bytes)
        ep_server, ep_client = RpcEndpoint(server, "bench"), RpcEndpoint(client, "bench")

        async def sink(request: Sink, tensors: list[torch.Tensor], ctx: Any) -> SinkReply:
            return SinkReply(received_bytes=sum(t.numel() for t in tensors))

        await ep_server.serve(method, sink)
        await server.p2p.add_binary_stream_handler(_RAW, _raw_handler)
        client.add_addresses(server.peer_id, await server.visible_maddrs())
        tensor = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8)
        payload = memoryview(tensor.numpy()).cast("B")
        ours, raw = [], []
        for _ in range(repeats + 1):  # the first round of each warms up (connection, allocator)
            start = time.perf_counter()
            reply = await ep_client.call(server.peer_id, method, Sink(), tensors=[tensor], timeout_s=300)
            ours.append(time.perf_counter() - start)
            assert reply.message.received_bytes == size_bytes
            raw.append(await _raw_send(client, server.peer_id, payload))
        ours_s, raw_s = statistics.median(ours[1:]), statistics.median(raw[1:])
        return {
            "size_mib": size_bytes / 2**20,
            "ours_s": ours_s,
            "raw_stream_s": raw_s,
            "ours_MBps": size_bytes / ours_s / 1e6,
            "raw_MBps": size_bytes / raw_s / 1e6,
            "ratio_ours_over_raw": raw_s / ours_s,
            "repeats": repeats,
        }
    finally:
        for host in hosts:
            await host.aclose()


def main(quick: bool) -> None:
    sizes = [64 * 2**20] if quick else [64 * 2**20, 256 * 2**20]
    repeats = 2 if quick else 3
    rows = [asyncio.run(_measure(size, repeats)) for size in sizes]
    for row in rows:
        print(
            f"  {row['size_mib']:.0f} MiB: ours/raw throughput = {row['ratio_ours_over_raw']:.2f}", flush=True
        )
    record(
        "transport",
        rows,
        notes=(
            "Throughput of one RPC call carrying a uint8 tensor (codec + envelope + framed libp2p stream + "
            "server-side checks) divided by a raw hivemind binary stream of the same bytes between the same "
            "two p2p daemons, same run, loopback, both ends in one event loop; median of `repeats` after "
            "one warm-up. Goal: ratio >= 0.8."
        ),
    )
