"""`python -m ravnest_p2p.peer`: start a volunteer peer and keep it running until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ravnest_p2p.cli_common import OneLineArgumentParser, fail, format_validation_error, load_toml, run_loop
from ravnest_p2p.errors import RavnestError
from ravnest_p2p.utils import configure_logging

if TYPE_CHECKING:  # the peer's modules import hivemind and torch (~3 s): only once the flags parse
    from ravnest_p2p.node import Peer, PeerConfig

__all__ = ["build_parser", "config_from_args", "main"]

PROG = "python -m ravnest_p2p.peer"
logger = logging.getLogger("ravnest_p2p.peer")


def build_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog=PROG, description="Run a ravnest_p2p volunteer peer.")
    p.add_argument(
        "--initial-peers",
        action="extend",
        nargs="+",
        metavar="MADDR",
        default=None,
        help="multiaddr(s) of peers already in the swarm (repeatable); omit to start a new swarm",
    )
    p.add_argument(
        "--identity-path", metavar="FILE", help="private key file; created if missing, never replaced"
    )
    p.add_argument(
        "--host-maddrs",
        action="extend",
        nargs="+",
        metavar="MADDR",
        default=None,
        help="multiaddrs to listen on (default /ip4/127.0.0.1/tcp/0)",
    )
    p.add_argument(
        "--announce-maddrs",
        action="extend",
        nargs="+",
        metavar="MADDR",
        default=None,
        help="multiaddrs others should use to reach this peer (explicit ports)",
    )
    p.add_argument("--run-id", help="training run to join (default: 'default')")
    p.add_argument(
        "--run-owner",
        metavar="PEER_ID",
        help="peer id of the run's owner: only its jobs are trained (omit: an open run, anyone's jobs)",
    )
    p.add_argument("--device", help="torch device to train on: cpu, cuda[:N], mps")
    p.add_argument("--max-memory-gb", type=float, help="cap on memory this peer offers, in GB (10**9 bytes)")
    p.add_argument(
        "--use-relay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="allow libp2p circuit relays (default on; --no-use-relay to disable)",
    )
    p.add_argument(
        "--use-auto-relay",
        action="store_true",
        default=None,
        help="look for relays to become reachable from behind NAT",
    )
    p.add_argument(
        "--client-mode",
        action="store_true",
        default=None,
        help="do not accept incoming connections (DHT client only)",
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with any PeerConfig field; flags override it")
    p.add_argument(
        "--log-level",
        default=os.environ.get("RAVNEST_LOG_LEVEL", "INFO").upper(),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="default: $RAVNEST_LOG_LEVEL, else INFO (the variable reaches peers a test or the lab starts)",
    )
    return p


def config_from_args(argv: Sequence[str] | None = None) -> tuple[PeerConfig, str]:
    """Parse flags (and the optional config file) into a validated `PeerConfig` and a log level."""
    args = build_parser().parse_args(argv)
    from ravnest_p2p.node import PeerConfig  # after the flags: a bad one fails in well under a second

    values: dict[str, Any] = load_toml(args.config) if args.config else {}
    for name in (
        "initial_peers",
        "identity_path",
        "host_maddrs",
        "announce_maddrs",
        "run_id",
        "run_owner",
        "device",
        "max_memory_gb",
        "use_relay",
        "use_auto_relay",
        "client_mode",
    ):
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    return PeerConfig.model_validate(values), args.log_level


async def _leave(peer: Peer, second_signal: asyncio.Event) -> None:
    """A graceful leave (`Peer.leave`); a second SIGINT/SIGTERM cuts the hand-over short."""
    tasks = {asyncio.ensure_future(peer.leave()), asyncio.ensure_future(second_signal.wait())}
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _serve(config: PeerConfig) -> int:
    from ravnest_p2p.node import Peer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        peer = await Peer.start(config)
    except RavnestError as exc:
        fail(str(exc), prog=PROG)
    try:
        owner = f"owner {config.run_owner}" if config.run_owner else "no owner: anyone's jobs are trained"
        print(f"ravnest_p2p peer {peer.peer_id} (run '{config.run_id}', {owner})", flush=True)
        for maddr in peer.maddrs:
            print(f"  join with: --initial-peers {maddr}", flush=True)
        while not stop.is_set():
            print(f"{time.strftime('%H:%M:%S')} status: {peer.status().line()}", flush=True)
            try:
                await asyncio.wait_for(stop.wait(), config.status_interval_s)
            except TimeoutError:
                pass
        logger.info(
            "leaving: announcing draining, handing the stage over (at most %.0fs)", config.drain_grace_s
        )
        stop.clear()
        await _leave(peer, stop)
    finally:
        await peer.aclose()
    print("stopped", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, log_level = config_from_args(argv)
    except ValidationError as exc:
        fail(format_validation_error(exc), code=2, prog=PROG)
    except ValueError as exc:
        fail(str(exc), code=2, prog=PROG)
    configure_logging(log_level)
    # before torch allocates anything big: freed tensors go back to the OS, so this peer's resident
    # memory follows what the planner's memory model counts (docs/memory.md)
    from ravnest_p2p.measurement.memory import limit_heap_retention

    limit_heap_retention()
    return run_loop(_serve(config))


if __name__ == "__main__":
    sys.exit(main())
