"""One peer of the hivemind-averager baseline, run inside a lab namespace (see bench_averager_baseline).

Starts a hivemind DHT at ``--host``:``--port`` joined to ``--initial-peers`` (every earlier peer, so that
each daemon is connected to every other: hivemind's averager cannot reach a peer its daemon never dialled),
prints ``{"maddrs": [...]}``, then runs ``--rounds`` averaging steps of a ``--size-bytes`` fp32 vector.
Each step matchmakes first, then waits for our trigger; the line printed per round carries the wall
time of our trigger and of the end of the all-reduce, so the orchestrator can time the all-reduce alone
as (last end - last trigger) over the group.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=31337)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--size-bytes", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bandwidth-mbps", type=float, default=None)
    args = parser.parse_args()

    maddr = f"/ip4/{args.host}/tcp/{args.port}"
    dht = DHT(
        initial_peers=args.initial_peers or None,
        host_maddrs=[maddr],
        announce_maddrs=[maddr],
        start=True,
        use_relay=False,
    )
    print(json.dumps({"maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
    vector = torch.ones(args.size_bytes // 4) * float(len(args.initial_peers))
    averager = DecentralizedAverager(
        [vector],
        dht,
        start=True,
        prefix="baseline",
        target_group_size=args.group_size,
        min_group_size=args.group_size,
        min_matchmaking_time=2.0,
        request_timeout=10.0,
        bandwidth=args.bandwidth_mbps,
        allreduce_timeout=600.0,
    )
    try:
        for i in range(args.rounds):
            start = time.time()
            control = averager.step(wait=False, require_trigger=True, timeout=900)
            while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
                time.sleep(0.01)  # matchmaking runs in the averager's process
            trigger_t = time.time()
            control.allow_allreduce()
            group = control.result()
            end_t = time.time()
            ok = group is not None
            print(
                json.dumps(
                    {
                        "round": i,
                        "ok": ok,
                        "group": len(group or {}),
                        "start_t": start,
                        "trigger_t": trigger_t,
                        "end_t": end_t,
                    }
                ),
                flush=True,
            )
        with averager.get_tensors() as tensors:
            print(json.dumps({"final_mean": float(tensors[0].mean())}), flush=True)
    finally:
        averager.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main()
