"""One end of the bandwidth-probe benchmark, run inside a lab namespace.

``serve``: start a p2p host at ``--host``:``--port``, serve the probe RPCs, print ``{"peer_id", "maddrs"}``,
run until killed. ``probe``: start a host, dial the server, run ``--rounds`` probes with the default
`ProbeConfig` (EMA off, so each line is one probe's reading) and print one JSON line per probe.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from ravnest_p2p.measurement.network import NetworkMeter, ProbeConfig
from ravnest_p2p.transport import HostConfig, P2PTransport, RpcEndpoint, load_or_create_identity


async def _host(host: str, port: int) -> P2PTransport:
    maddr = f"/ip4/{host}/tcp/{port}"
    config = HostConfig(
        host_maddrs=(maddr,), announce_maddrs=(maddr,), use_relay=False, check_identity_free=False
    )
    return await P2PTransport.create(config, load_or_create_identity(None))


async def _serve(host: str, port: int) -> None:
    transport = await _host(host, port)
    try:
        await NetworkMeter(RpcEndpoint(transport, "bench")).serve()
        print(
            json.dumps({"peer_id": transport.peer_id, "maddrs": await transport.visible_maddrs()}), flush=True
        )
        await asyncio.Event().wait()
    finally:
        await transport.aclose()


async def _probe(host: str, port: int, server: str, rounds: int) -> None:
    transport = await _host(host, port)
    try:
        peer_id = server.rsplit("/p2p/", 1)[1]
        transport.add_addresses(peer_id, [server])
        meter = NetworkMeter(RpcEndpoint(transport, "bench"), ProbeConfig(ema_alpha=1.0))
        for i in range(rounds):
            link = await meter.probe(peer_id)
            print(
                json.dumps(
                    {
                        "round": i,
                        "upload_mbps": link.upload_mbps,
                        "download_mbps": link.download_mbps,
                        "probe_bytes": link.probe_bytes,
                        "rtt_ms": link.rtt_ms,
                    }
                ),
                flush=True,
            )
    finally:
        await transport.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["serve", "probe"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=31337)
    parser.add_argument("--server", help="the server's full multiaddr (probe mode)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.mode == "serve":
        asyncio.run(_serve(args.host, args.port))
    else:
        asyncio.run(_probe(args.host, args.port, args.server, args.rounds))


if __name__ == "__main__":
    main()
