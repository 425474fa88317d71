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
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import record
from ravnest_p2p.averaging import RingAllReduce, RingConfig, build_shard_map
from ravnest_p2p.transport import HostConfig, P2PTransport, RpcEndpoint, load_or_create_identity

NUM_PEERS = 4
_ROOT = Path(__file__).resolve().parents[1]
_CONFIGS = {"none": RingConfig(), "fp16": RingConfig(compression="fp16")}
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
    await sender.ensure_connected(receiver.peer_id)  # dial by multiaddr, as every RPC call does first
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


async def _worker(index: int, numel: int) -> None:
    """One peer in its own process (like hivemind's averagers): JSON lines on stdin/stdout with the parent."""
    loop = asyncio.get_running_loop()
    torch.set_num_threads(1)  # 4 peers share 2 cores: no intra-op pools fighting each other

    async def read_line() -> Any:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        return json.loads(line) if line.strip() else None

    def write_line(obj: Any) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    transport = await P2PTransport.create(HostConfig(), load_or_create_identity(None))
    servers: dict[str, RingAllReduce] = {}
    try:
        write_line({"peer_id": transport.peer_id, "maddrs": await transport.visible_maddrs()})
        peers = (await read_line())["peers"]
        for peer_id, maddrs in peers.items():
            if peer_id != transport.peer_id:
                transport.add_addresses(peer_id, maddrs)
        shard_map = build_shard_map([[(p, [("0.weight", numel)])] for p in peers], epoch=0)
        tensors = _tensors(numel)
        expected = torch.stack([t.double() for t in tensors]).mean(0)
        for label, config in _CONFIGS.items():
            servers[label] = RingAllReduce(RpcEndpoint(transport, f"bench-{label}"), config)
            await servers[label].start()
        write_line({"ready": True})
        while (command := await read_line()) is not None:
            server = servers[command["label"]]
            averaged, metrics = await server.all_reduce(
                shard_map, {"0.weight": tensors[index]}, round_index=command["round"]
            )
            error = (averaged["0.weight"].double() - expected).abs().max().item()
            participants = len(metrics.rings[0].participants)
            write_line(
                {
                    "time_s": metrics.time_s,
                    "bytes_sent": metrics.bytes_sent,
                    "error": error,
                    "participants": participants,
                }
            )
    finally:
        for server in servers.values():
            await server.aclose()
        await transport.aclose()


async def _ours_processes(size_bytes: int, repeats: int) -> dict[str, Any]:
    numel = size_bytes // 4
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.bench_averaging",
            "worker",
            str(i),
            str(numel),
            cwd=_ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for i in range(NUM_PEERS)
    ]

    async def ask(proc: asyncio.subprocess.Process, obj: Any) -> Any:
        assert proc.stdin is not None
        assert proc.stdout is not None
        if obj is not None:
            proc.stdin.write((json.dumps(obj) + "\n").encode())
            await proc.stdin.drain()
        return json.loads(await asyncio.wait_for(proc.stdout.readline(), 300))

    try:
        hello = [await ask(p, None) for p in procs]
        peers = {h["peer_id"]: h["maddrs"] for h in hello}
        await asyncio.gather(*(ask(p, {"peers": peers}) for p in procs))
        runs: dict[str, Any] = {}
        round_index = 0
        for label in _CONFIGS:
            times, errors, sent = [], [], []
            for r in range(repeats + 1):
                replies = await asyncio.gather(
                    *(ask(p, {"label": label, "round": round_index}) for p in procs)
                )
                round_index += 1
                assert all(x["participants"] == NUM_PEERS for x in replies), replies
                if r == 0:
                    continue
                times.append(max(x["time_s"] for x in replies))
                errors.append(max(x["error"] for x in replies))
                sent.append(statistics.mean(x["bytes_sent"] for x in replies))
            runs[label] = {"times": times, "max_abs_error": max(errors), "bytes_sent": sent[0]}
        return runs
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.write(b"null\n")
                with contextlib.suppress(ConnectionError):
                    await proc.stdin.drain()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


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
    if "--lab-only" in sys.argv:  # python -m benchmarks.bench_averaging --lab-only: the namespaced runs
        _lab(quick)
        return
    size_bytes = (16 if quick else 64) << 20
    repeats = 3 if quick else 5
    ours = asyncio.run(_ours(size_bytes, repeats, _CONFIGS))
    ours_processes = asyncio.run(_ours_processes(size_bytes, repeats))
    theirs = _hivemind(size_bytes, repeats)
    raw = ours["raw_stream_bytes_per_s"]
    bound_s = 2 * (NUM_PEERS - 1) / NUM_PEERS * size_bytes / raw
    ring_median = statistics.median(ours_processes["none"]["times"])
    rows: list[dict[str, Any]] = []
    runs = [(f"{k}, 4 processes", v) for k, v in ours_processes.items()]
    runs += [(f"{k}, 1 process", v) for k, v in ours["runs"].items()]
    for label, run in runs:
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
        "Ours: default RingConfig (1 MiB parts on one stream per ring and attempt, raw payloads); "
        "fp16 halves the bytes. "
        "hivemind: target/min group 4, min_matchmaking_time 2 s, default 512 KiB parts."
    )
    path = record("averaging", rows, notes=notes)
    print(f"wrote {path}")
    if os.geteuid() == 0 and "--no-lab" not in sys.argv:
        _lab(quick)


def _lab(quick: bool) -> None:
    """Ours vs hivemind's averager on lab namespaces (root only): 100 Mbit/s uniform and 25/50/100/200."""
    from benchmarks.averaging_lab import GOODPUT, run_scenario

    size_bytes = (16 if quick else 64) * 1_000_000
    rounds = 1 if quick else 3
    rows = []
    for rates in ([100.0] * NUM_PEERS, [25.0, 50.0, 100.0, 200.0]):
        scenario = run_scenario(rates, size_bytes, rounds)
        rows += scenario
        for row in scenario:
            print(f"  {row['links_mbps']} {row['system']}: {row['median_s']:.2f} s", flush=True)
    notes = (
        f"S = {size_bytes / 1e6:g} MB of fp32 among C = {NUM_PEERS} peers, each in its own lab namespace "
        "(htb, symmetric links at the listed Mbit/s), same namespaces for both systems in one run; "
        f"median of {rounds} round(s) after a warm-up round (its time: first_round_s). Lab peers run TCP "
        "Reno (the lab's default, standing in for volunteers' CUBIC; the host's BBR lost 18 % of an uplink "
        "that also carried an incoming flow's ACKs). Ours: RingAllReduce, default RingConfig, rounds "
        "started at one "
        "wall-clock instant, time = last end - start; with unequal links once with equal chunks and once "
        "with chunks sized by link rate (every peer told every peer's rate, as the agreed plan would; "
        "uniform links give equal chunks either way), and once more paced (RingConfig.pace_fraction: each "
        "stream sent at that fraction of its link's payload rate). "
        "hivemind 1.1.12 DecentralizedAverager told each peer's bandwidth (its load balancing), "
        "daemons dialled to each other first, time = last end - last trigger (matchmaking excluded). "
        "Bound = 2(C-1)/C*S/B_min at the wire rate; the payload "
        f"bound uses the TCP payload rate {GOODPUT}*B_min that htb delivers. efficiency = bound / time; "
        "efficiency_vs_ring_bound uses the busiest link's time under the chunks weights.py picks for the "
        "ring's order (= 2(C-1)/C*S/B_min for equal chunks). MB_sent_max_min: payload MB sent by the "
        "busiest/least busy peer."
    )
    path = record("averaging_lab", rows, notes=notes)
    print(f"wrote {path}")


if __name__ == "__main__":  # a worker process of `_ours_processes`
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        asyncio.run(_worker(int(sys.argv[2]), int(sys.argv[3])))
    else:
        main(quick="--quick" in sys.argv)
