"""`python -m ravnest_p2p.status`: join the DHT as a client and print the run's live peers and owner.

Who owns a run is what its peers enforce: each peer's signed record names the owner whose jobs it
trains (``--run-owner`` of the peer), or none (an open run: anyone's job is trained). With
``--run-owner`` the tool also says how many peers enforce a different owner, or none.

With ``--serve HOST:PORT`` it serves a live dashboard page of the run instead (`ravnest_p2p.dashboard`,
docs/dashboard.md): loopback addresses only, unless ``--serve-public`` is given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ravnest_p2p.cli_common import OneLineArgumentParser, fail, run_loop
from ravnest_p2p.errors import RavnestError

if TYPE_CHECKING:  # the DHT side imports hivemind (~2 s): only when a swarm is read, not for a bad flag
    from ravnest_p2p.discovery import PeerRecord

__all__ = [
    "fetch_peers",
    "fetch_run",
    "format_owner",
    "format_plan",
    "format_serving",
    "format_table",
    "main",
    "no_peers_hint",
    "run_owners",
]

PROG = "python -m ravnest_p2p.status"


async def fetch_peers(
    initial_peers: Sequence[str], run_id: str, *, timeout_s: float = 20.0
) -> list[PeerRecord]:
    """Join as a DHT client through `initial_peers` and return the run's valid records, sorted by peer id."""
    records, _, _ = await fetch_run(initial_peers, run_id, timeout_s=timeout_s)
    return records


async def fetch_run(
    initial_peers: Sequence[str], run_id: str, *, timeout_s: float = 20.0, run_owner: str | None = None
) -> tuple[list[PeerRecord], int, dict[str, str]]:
    """Records (sorted by peer id), the newest epoch they report, and that epoch's ``plan`` digests."""
    from ravnest_p2p.discovery import PeerDirectory, RunDHT
    from ravnest_p2p.membership import DhtPlanBoard
    from ravnest_p2p.training.run_keys import run_keys

    dht = await RunDHT.join_as_client(
        initial_peers, run_id=run_id, timeout_s=timeout_s, keys=run_keys(), run_owner=run_owner
    )
    try:
        directory = PeerDirectory(dht, dht.transport, dial_new_peers=True)
        peers = await directory.refresh()  # read via our initial peers, then dial whom they name
        if directory.num_dialled:
            peers = await directory.refresh()  # now every replica of the key can answer
        epoch = max((r.epoch for r in peers.values()), default=0)
        digests = await DhtPlanBoard(dht).read(epoch)
    finally:
        await dht.aclose()
    return sorted(peers.values(), key=lambda r: r.peer_id), epoch, digests


def format_plan(records: Sequence[PeerRecord], epoch: int, digests: dict[str, str]) -> str:
    """One line: the epoch, how many clusters/stages records report, and agreement on the digest."""
    placed = [r for r in records if r.epoch == epoch and r.cluster is not None]
    num_clusters = len({r.cluster for r in placed})
    top = Counter(digests.values()).most_common(1)
    agree = f"{top[0][1]}/{len(digests)} agree on {top[0][0][:12]}" if top else "no digest published"
    return f"epoch {epoch}: {num_clusters} clusters, {len(placed)} stages placed; plan digests: {agree}"


def run_owners(records: Sequence[PeerRecord]) -> Counter[str | None]:
    """How many peers enforce each owner (None: open run) according to their signed records."""
    return Counter(r.run_owner for r in records if not r.client_mode)


def format_owner(records: Sequence[PeerRecord], run_owner: str | None = None) -> str:
    """One line: who owns the run, as its peers enforce it (and against `run_owner`, if given)."""
    owners = run_owners(records)
    total = sum(owners.values())
    if not owners:
        return f"owner: {run_owner or 'unknown'} (no peers)"
    top, count = owners.most_common(1)[0]
    if top is None:
        line = f"open run: no owner; {count}/{total} peers train anyone's job (start peers with --run-owner)"
    else:
        line = f"owner: {top} ({count}/{total} peers enforce it)"
    if len(owners) > 1:
        others = ", ".join(
            f"{n} {'open' if o is None else 'owned by …' + o[-8:]}" for o, n in owners.items() if o != top
        )
        line += f"; WARNING other peers: {others}"
    if run_owner is not None and owners.get(run_owner, 0) != total:
        line += f"; WARNING {total - owners.get(run_owner, 0)}/{total} peers do not enforce owner {run_owner}"
    return line


def format_table(records: Sequence[PeerRecord]) -> str:
    columns = [("peer", "<14"), ("state", "<9"), ("GFLOP/s", ">9"), ("mem GB", ">7")]
    columns += [("up Mb/s", ">9"), ("down Mb/s", ">9"), ("rtt ms", ">7"), ("epoch", ">5"), ("cl/st", ">7")]
    lines = [" ".join(f"{name:{spec}}" for name, spec in columns)]
    for r in records:
        rtt = f"{r.rtt_ms:.1f}" if r.rtt_ms is not None else "-"
        place = f"{r.cluster}/{r.stage}" if r.cluster is not None else "-"
        lines.append(
            f"…{r.peer_id[-12:]:<13} {r.state:<9} {r.flops / 1e9:>9.1f} {r.free_memory_bytes / 2**30:>7.1f} "
            f"{r.upload_mbps:>9.1f} {r.download_mbps:>9.1f} {rtt:>7} {r.epoch:>5} {place:>7}"
        )
    lines.append(f"{len(records)} peers")
    lines += format_serving(records)
    return "\n".join(lines)


def format_serving(records: Sequence[PeerRecord]) -> list[str]:
    """A line per peer that serves plugins, and per peer that said it cannot serve a job (and why)."""
    lines = []
    for r in records:
        if r.plugin_models or r.plugin_datasets:
            lines.append(
                f"…{r.peer_id[-12:]} serves plugin models [{', '.join(r.plugin_models)}], "
                f"data sets [{', '.join(r.plugin_datasets)}]"
            )
        if r.unfit_job is not None:
            lines.append(f"…{r.peer_id[-12:]} cannot serve job {r.unfit_job}: {r.unfit_reason or '?'}")
    return lines


def no_peers_hint(run_id: str, *, run_id_given: bool) -> str:
    """What to try when the run shows no peer: peers are found only under the run id they joined."""
    hint = f"no peer of run '{run_id}' found. Peers list only under the run id they were started with"
    if not run_id_given:
        return hint + " (their --run-id): pass it here as --run-id, e.g. --run-id my-run."
    return hint + "; check the id, and that the peers are up and reachable through --initial-peers."


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog=PROG, description="List the live peers of a ravnest_p2p run.")
    parser.add_argument("--initial-peers", action="extend", nargs="+", required=True, metavar="MADDR")
    parser.add_argument("--run-id", help="the run to list (default: 'default', as for peers)")
    parser.add_argument("--run-owner", metavar="PEER_ID", help="the owner's peer id the peers should enforce")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--serve", metavar="HOST:PORT", help="serve a live dashboard page there instead")
    parser.add_argument("--serve-public", action="store_true", help="allow --serve on a non-loopback address")
    args = parser.parse_args(argv)

    run_id: str = args.run_id or "default"
    initial_peers: list[str] = args.initial_peers
    if args.serve is not None:
        return _serve(args, initial_peers, run_id)

    async def run() -> int:
        try:
            records, epoch, digests = await fetch_run(initial_peers, run_id, run_owner=args.run_owner)
        except RavnestError as exc:
            fail(str(exc), prog=PROG)
        if args.json:
            peers_json = [r.model_dump(mode="json") for r in records]
            owners = run_owners(records)
            out = {
                "run_id": run_id,
                "run_owner": owners.most_common(1)[0][0] if owners else args.run_owner,
                "owner_line": format_owner(records, args.run_owner),
                "epoch": epoch,
                "plan_digests": digests,
                "time": time.time(),
                "peers": peers_json,
            }
            print(json.dumps(out))
        else:
            print(time.strftime("%Y-%m-%d %H:%M:%S %Z"))
            print(format_table(records))
            if not records:
                print(no_peers_hint(run_id, run_id_given=args.run_id is not None))
            print(format_owner(records, args.run_owner))
            print(format_plan(records, epoch, digests))
        return 0

    return run_loop(run())


def _serve(args: argparse.Namespace, initial_peers: list[str], run_id: str) -> int:
    from ravnest_p2p.dashboard import check_bind, parse_bind, serve_dashboard

    try:
        host, port = parse_bind(args.serve)
        check_bind(host, public=args.serve_public)
    except ValueError as exc:
        fail(str(exc), code=2, prog=PROG)
    try:
        serving = serve_dashboard(initial_peers, run_id, host=host, port=port, run_owner=args.run_owner)
        return run_loop(serving)
    except (RavnestError, OSError) as exc:
        fail(str(exc), prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
