"""Averaging S bytes among 4 peers on loopback: our ring vs. hivemind's DecentralizedAverager vs. the bound.

All three figures come from one run on the same machine: our `RingAllReduce` (4 in-process peers, each
with its own p2p daemon, one ring of 4), hivemind's `DecentralizedAverager` (4 process-wrapped averagers
on 4 DHTs, same tensor size) and the bandwidth bound 2(C-1)/C * S/B, where B is the throughput of one raw
libp2p stream measured between two of our daemons just before (loopback has no nominal bandwidth).

hivemind's round is reported two ways: the all-reduce alone (from the trigger to the result, after its
matchmaking has formed the group) and the whole `step()` including matchmaking. Ours has no matchmaking:
the plan fixes the rings. Both share 2 cores with their daemons, so the bound (one stream at a time) is
optimistic: the 4 peers' streams, sums and daemons compete for the same CPUs.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import torch

from benchmarks.harness import record
from ravnest_p2p.averaging import RingAllReduce, RingConfig, build_shard_map
from ravnest_p2p.transport import HostConfig, P2PTransport, RpcEndpoint, load_or_create_identity

NUM_PEERS = 4
_RAW_PROTOCOL = "bench/raw-stream"


def _tensors(numel: int) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(NUM_PEERS)]


async def _raw_stream_bytes_per_s(sender: P2PTransport, receiver: P2PTransport, size_bytes: int) -> float:
    """Throughput of one libp2p stream: write `size_bytes`, wait for the receiver's 1-byte ack."""

    async def sink(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remaining = size_bytes
        while remaining > 0:
            chunk = await reader.read(min(remaining, 1 << 20))
            if not chunk:
                break
            remaining -= len(chunk)
        writer.write(b"k")
        await writer.drain()
        writer.close()

    await receiver.p2p.add_binary_stream_handler(_RAW_PROTOCOL, sink)
    await sender._ensure_connected(receiver.peer_id)  # dial by multiaddr, as every RPC call does first
    payload = bytes(1 << 20)
    best = 0.0
    for _ in range(2):
        started = time.perf_counter()
        _, reader, writer = await sender.p2p.call_binary_stream_handler(receiver.p2p.peer_id, _RAW_PROTOCOL)
        sent = 0
        while sent < size_bytes:
            n = min(len(payload), size_bytes - sent)
            writer.write(payload[:n])
            await writer.drain()
            sent += n
        await asyncio.wait_for(reader.readexactly(1), 120)
        writer.close()
        best = max(best, size_bytes / (time.perf_counter() - started))
    await receiver.p2p.remove_binary_stream_handler(_RAW_PROTOCOL)
    return best


async def _ours(size_bytes: int, repeats: int, configs: dict[str, RingConfig]) -> dict[str, Any]:
    numel = size_bytes // 4
    transports = list(
        await asyncio.gather(
            *(P2PTransport.create(HostConfig(), load_or_create_identity(None)) for _ in range(NUM_PEERS))
        )
    )
    try:
        maddrs = {t.peer_id: await t.visible_maddrs() for t in transports}
        for t in transports:
            for peer_id, addrs in maddrs.items():
                if peer_id != t.peer_id:
                    t.add_addresses(peer_id, addrs)
        raw = await _raw_stream_bytes_per_s(transports[0], transports[1], size_bytes)
        shard_map = build_shard_map([[(t.peer_id, [("0.weight", numel)])] for t in transports], epoch=0)
        tensors = _tensors(numel)
        expected = torch.stack([t.double() for t in tensors]).mean(0)
        out: dict[str, Any] = {"raw_stream_bytes_per_s": raw, "runs": {}}
        round_index = 0
        for label, config in configs.items():
            servers = [RingAllReduce(RpcEndpoint(t, f"bench-{label}"), config) for t in transports]
            for server in servers:
                await server.start()
            times, errors, sent = [], [], []
            for r in range(repeats + 1):  # the first round warms connections up and is not counted
                results = await asyncio.gather(
                    *(
                        s.all_reduce(shard_map, {"0.weight": tensors[i]}, round_index=round_index)
                        for i, s in enumerate(servers)
                    )
                )
                round_index += 1
                if r == 0:
                    continue
                times.append(max(m.time_s for _, m in results))
                sent.append(statistics.mean(m.bytes_sent for _, m in results))
                errors.append(
                    max((avg["0.weight"].double() - expected).abs().max().item() for avg, _ in results)
                )
                assert all(len(m.rings[0].participants) == NUM_PEERS for _, m in results)
            for server in servers:
                await server.aclose()
            out["runs"][label] = {"times": times, "max_abs_error": max(errors), "bytes_sent": sent[0]}
        return out
    finally:
        await asyncio.wait_for(asyncio.gather(*(t.aclose() for t in transports), return_exceptions=True), 60)


def _hivemind(size_bytes: int, repeats: int) -> dict[str, Any]:
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage
    from hivemind.dht import DHT

    numel = size_bytes // 4
    dhts = [DHT(start=True)]
    dhts += [DHT(initial_peers=dhts[0].get_visible_maddrs(), start=True) for _ in range(NUM_PEERS - 1)]
    tensors = _tensors(numel)
    expected = torch.stack([t.double() for t in tensors]).mean(0)
    averagers = []
    try:
        for dht, tensor in zip(dhts, tensors, strict=True):
            averagers.append(
                DecentralizedAverager(
                    [tensor.clone()],
                    dht,
                    prefix="bench_avg",
                    target_group_size=NUM_PEERS,
                    min_group_size=NUM_PEERS,
                    min_matchmaking_time=2.0,
                    request_timeout=3.0,
                    start=True,
                )
            )
        allreduce_s, step_s, errors = [], [], []
        for r in range(repeats + 1):
            for averager, tensor in zip(averagers, tensors, strict=True):
                with averager.get_tensors() as local:
                    local[0].copy_(tensor)
            started = time.perf_counter()
            controls = [a.step(wait=False, require_trigger=True, timeout=180) for a in averagers]
            deadline = time.monotonic() + 120
            while not all(c.stage == AveragingStage.AWAITING_TRIGGER or c.done() for c in controls):
                if time.monotonic() > deadline:
                    raise TimeoutError("hivemind matchmaking did not form a group of 4")
                time.sleep(0.005)
            triggered = time.perf_counter()
            for control in controls:
                control.allow_allreduce()
            for control in controls:
                control.result(timeout=180)
            finished = time.perf_counter()
            if r == 0:
                continue
            allreduce_s.append(finished - triggered)
            step_s.append(finished - started)
            with averagers[0].get_tensors() as local:
                errors.append((local[0].double() - expected).abs().max().item())
        return {"allreduce": allreduce_s, "step": step_s, "max_abs_error": max(errors)}
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def _stats(values: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values)}


def main(quick: bool = False) -> None:
    size_bytes = (16 if quick else 64) << 20
    repeats = 3 if quick else 5
    configs = {
        "none": RingConfig(),
        "fp16": RingConfig(compression="fp16"),
    }
    ours = asyncio.run(_ours(size_bytes, repeats, configs))
    theirs = _hivemind(size_bytes, repeats)
    raw = ours["raw_stream_bytes_per_s"]
    bound_s = 2 * (NUM_PEERS - 1) / NUM_PEERS * size_bytes / raw
    ring_median = statistics.median(ours["runs"]["none"]["times"])
    rows: list[dict[str, Any]] = []
    for label, run in ours["runs"].items():
        stats = _stats(run["times"])
        rows.append(
            {
                "system": f"ours: RingAllReduce ({label})",
                **stats,
                "vs_bound": stats["median_s"] / bound_s,
                "vs_ours_none": stats["median_s"] / ring_median,
                "max_abs_error": run["max_abs_error"],
                "MB_sent_per_peer": run["bytes_sent"] / 1e6,
            }
        )
    for key, label in (("allreduce", "all-reduce only"), ("step", "step incl. matchmaking")):
        stats = _stats(theirs[key])
        rows.append(
            {
                "system": f"hivemind DecentralizedAverager ({label})",
                **stats,
                "vs_bound": stats["median_s"] / bound_s,
                "vs_ours_none": stats["median_s"] / ring_median,
                "max_abs_error": theirs["max_abs_error"],
            }
        )
    rows.append(
        {
            "system": "bound 2(C-1)/C*S/B",
            "median_s": bound_s,
            "vs_bound": 1.0,
            "vs_ours_none": bound_s / ring_median,
        }
    )
    notes = (
        f"S = {size_bytes >> 20} MiB of fp32 averaged among C = {NUM_PEERS} peers on loopback "
        f"(2 shared cores), {repeats} rounds after one warm-up round, round time = slowest peer. "
        f"B = one raw libp2p stream measured in the same run: {raw / 1e6:.0f} MB/s. "
        "Ours: default RingConfig (2 MiB parts over streams, 4 in flight); fp16 halves the bytes. "
        "hivemind: target/min group 4, min_matchmaking_time 2 s, default 512 KiB parts."
    )
    path = record("averaging", rows, notes=notes)
    print(f"wrote {path}")
