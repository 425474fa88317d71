"""One peer of our ring in a lab namespace (`benchmarks.averaging_lab`): JSON lines out, a control file in.

Starts a `P2PTransport` at ``--host``:``--port``, prints ``{"peer_id", "maddrs"}``, then waits for the
control file (written atomically by the orchestrator) to list every peer, and runs one ring round per
``"round<k>"`` entry at its wall-clock ``start_at`` (the same clock in every namespace), printing
``{"round", "start_t", "end_t", "participants", "error"}``; it exits once the file holds ``"exit"``.
If the file also holds ``"rates_mbps"`` (peer id -> symmetric link rate), rounds size their chunks by
rate (`link_rates=`, as payload bytes/s), as a run on the agreed plan would; ``--pace-fraction`` paces
each stream to that fraction of its link's payload rate.
Peer i averages ``base + (i - (C-1)/2)``, so the exact mean is ``base`` (the same seeded vector at
every peer) and each peer checks its own error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from ravnest_p2p.averaging import RingAllReduce, RingConfig, build_shard_map
from ravnest_p2p.transport import HostConfig, P2PTransport, RpcEndpoint, load_or_create_identity

_GOODPUT = 0.957  # TCP payload / wire rate on the lab's links (lab/netns.py)


async def _control(path: Path, key: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            data = json.loads(path.read_text())  # noqa: ASYNC240  # a tiny local file
            if key in data:
                return data[key]
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {key!r} in {path}")
        await asyncio.sleep(0.05)  # polling a file, bounded by the deadline


async def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    maddr = f"/ip4/{args.host}/tcp/{args.port}"
    host = HostConfig(host_maddrs=(maddr,), announce_maddrs=(maddr,), use_relay=False)
    transport = await P2PTransport.create(host, load_or_create_identity(None))
    config = RingConfig(
        part_size_bytes=args.part_size_bytes,
        step_timeout_s=60.0,
        round_timeout_s=900.0,
        probe_timeout_s=5.0,
        pace_fraction=args.pace_fraction,
    )
    server = RingAllReduce(RpcEndpoint(transport, "lab-avg"), config)
    await server.start()
    try:
        print(
            json.dumps({"peer_id": transport.peer_id, "maddrs": await transport.visible_maddrs()}), flush=True
        )
        peers: dict[str, list[str]] = await _control(args.control, "peers", 300)
        for peer_id, maddrs in peers.items():
            if peer_id != transport.peer_id:
                transport.add_addresses(peer_id, maddrs)
        order = sorted(peers)
        control = json.loads(args.control.read_text())  # "rates_mbps" is written together with "peers"
        rates_mbps: dict[str, float] | None = control.get("rates_mbps")
        # what a bandwidth probe would report: the TCP payload rate, in bytes/s
        goodput = {p: r * 1e6 / 8 * _GOODPUT for p, r in (rates_mbps or {}).items()}
        link_rates = None if rates_mbps is None else {p: (r, r) for p, r in goodput.items()}
        shard_map = build_shard_map([[(p, [("0.weight", args.numel)])] for p in order], epoch=0)
        base = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
        offset = order.index(transport.peer_id) - (len(order) - 1) / 2
        mine = base + offset
        for k in range(args.rounds):
            start_at = await _control(args.control, f"round{k}", 1800)
            await asyncio.sleep(max(0.0, start_at - time.time()))
            start_t = time.time()
            averaged, metrics = await server.all_reduce(
                shard_map, {"0.weight": mine}, round_index=k, link_rates=link_rates
            )
            end_t = time.time()
            error = (averaged["0.weight"].double() - base.double()).abs().max().item()
            line = {
                "round": k,
                "start_t": start_t,
                "end_t": end_t,
                "participants": len(metrics.rings[0].participants),
                "error": error,
                "bytes_sent": metrics.bytes_sent,
            }
            print(json.dumps(line), flush=True)
        # stay up until every peer is done: closing at once could cut a neighbour's last acks
        await _control(args.control, "exit", 1800)
    finally:
        await server.aclose()
        await transport.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=31400)
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--part-size-bytes", type=int, default=RingConfig().part_size_bytes)
    parser.add_argument("--control", type=Path, required=True)
    parser.add_argument("--pace-fraction", type=float, default=None)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    logging.getLogger("ravnest_p2p.averaging.partstream").setLevel(logging.DEBUG)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
