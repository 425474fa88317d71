# ruff: noqa: RUF001, RUF002, E501  (result text uses math notation; its long lines are prose)
"""IST over real p2p daemons on loopback: bytes on the wire per worker per round, and accuracy vs rounds.

`PYTHONPATH=src:. python -m benchmarks.ist_network [--width 2048] [--epochs 8]` (or `python -m benchmarks
ist_network`) writes benchmarks/results/ist_network.{json,md}.

For n = 2 and 4 workers, n `IstRunner`s on n real libp2p daemons (loopback, one process) train a
`wide_mlp` 64-W-W-10 on digits; every round's traffic is read from the endpoints' wire counters
(`RpcEndpoint.bytes_received["ist_pull"]`: encoded messages as handed to / taken from the transport).
Compared with what data parallelism moves for the same model: a ring all-reduce sends and receives
2(n−1)/n × the model per worker per step (K steps per IST round), local SGD with the same K once per
round. Accuracy vs rounds comes from the in-process runs on the same batches: IST (`train_ist_round`,
which the networked IST equals bit for bit: tests/unit/training/test_ist_network.py), synchronous data
parallel (one step on the n workers' batches per step) and local SGD (K steps per worker, then average).
Loopback has no bandwidth limit, so times here say nothing about slow links (the lab run is not done).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ravnest_p2p.models import build_model, make_loss
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.strategies import ist_bytes_per_worker, train_ist_round
from ravnest_p2p.training.ist_runner import IstRunner
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.modes import IstConfig
from ravnest_p2p.training.role import role_for
from ravnest_p2p.training.stages import load_dataset
from ravnest_p2p.training.sync_shard import SyncBatches
from ravnest_p2p.transport import HostConfig, P2PTransport, RpcEndpoint, load_or_create_identity

RESULTS = Path(__file__).parent / "results"
LOCAL_STEPS = 5
LR = 0.05


def _job(workers: list[str], width: int, epochs: int) -> JobSpec:
    params = {"in_features": 64, "hidden_features": [width, width], "out_features": 10}
    end = len(build_model("wide_mlp", params))
    return JobSpec(
        job_id=f"ist-bench-{len(workers)}",
        model="wide_mlp",
        model_params=params,
        dataset="digits",
        batch_size=32,
        num_epochs=epochs,
        seed=0,
        optimizer=OptimizerConfig(name="sgd", lr=LR),
        mode="ist",
        ist=IstConfig(num_workers=len(workers), local_steps=LOCAL_STEPS, peer_timeout_s=30),
        assignment=tuple((StagePlacement(peer_id=w, first_layer=0, end_layer=end),) for w in workers),
    )


async def _network_run(n: int, width: int, epochs: int) -> dict[str, Any]:
    transports = list(
        await asyncio.gather(
            *(P2PTransport.create(HostConfig(), load_or_create_identity(None)) for _ in range(n))
        )
    )
    try:
        maddrs = {t.peer_id: await t.visible_maddrs() for t in transports}
        for t in transports:
            for peer_id, addrs in maddrs.items():
                if peer_id != t.peer_id:
                    t.add_addresses(peer_id, addrs)
        job = _job([t.peer_id for t in transports], width, epochs)
        runners = []
        for t in transports:
            role = role_for(job, None, t.peer_id)
            assert role is not None
            runners.append(IstRunner(RpcEndpoint(t, f"ist-bench-{n}"), None, job, role))
        began = time.monotonic()
        metrics = await asyncio.gather(*(r.run() for r in runners))
        wall_s = time.monotonic() - began
    finally:
        await asyncio.gather(*(t.aclose() for t in transports), return_exceptions=True)
    rounds = runners[0].num_rounds
    workers = []
    for runner, m in zip(runners, metrics, strict=True):
        pulled = [e["bytes_pulled"] for e in runner.round_log[1:]]  # round 0: everyone has the seed model
        workers.append(
            {
                "eval_accuracy": m.eval_accuracy,
                "eval_loss": m.eval_loss,
                "mean_round_bytes_received": sum(pulled) / max(1, len(pulled)),
                "max_round_bytes_received": max(pulled, default=0),
                "total_bytes_received": runner.rpc.bytes_received["ist_pull"],
                "total_bytes_sent": runner.rpc.bytes_sent["ist_pull"],
                "mean_round_s": sum(e["seconds"] for e in runner.round_log) / len(runner.round_log),
            }
        )
    return {
        "rounds": rounds,
        "steps_per_worker": runners[0].steps,
        "wall_s": wall_s,
        "workers": workers,
        "job": job,
    }


def _evaluate(layers: list[nn.Module], job: JobSpec) -> float:
    held_out = load_dataset(job)[1]
    model = nn.Sequential(*layers).eval()
    with torch.no_grad():
        return float((model(held_out.inputs).argmax(-1) == held_out.labels).float().mean())


def _curves(job: JobSpec, n: int, steps: int, every: int) -> dict[str, list[tuple[int, float]]]:
    """Accuracy after rounds of K steps: in-process IST, data parallel and local SGD on the same batches."""
    train = load_dataset(job)[0]
    batches = SyncBatches(train, batch_size=job.batch_size, seed=job.seed, num_workers=n)
    loss_fn = make_loss("cross_entropy")
    k = LOCAL_STEPS
    rounds = -(-steps // k)
    ist = build_model(job.model, job.model_params, seed=job.seed)
    dp = nn.Sequential(*build_model(job.model, job.model_params, seed=job.seed))
    dp_opt = torch.optim.SGD(dp.parameters(), lr=LR)
    local = nn.Sequential(*build_model(job.model, job.model_params, seed=job.seed))
    out: dict[str, list[tuple[int, float]]] = {"ist": [], "data_parallel": [], "local_sgd": []}
    for r in range(rounds):
        span = range(r * k, min(steps, (r + 1) * k))
        train_ist_round(
            ist,
            [[batches.batch(s, w) for s in span] for w in range(n)],
            round_index=r,
            seed=job.seed,
            lr=LR,
            loss_fn=loss_fn,
        )
        for s in span:  # data parallel: the mean gradient of the n workers' batches, one step
            parts = [batches.batch(s, w) for w in range(n)]
            dp.train()
            dp_opt.zero_grad()
            loss_fn(dp(torch.cat([x for x, _ in parts])), torch.cat([y for _, y in parts])).backward()
            dp_opt.step()
        replicas = []
        for w in range(n):  # local SGD: K steps per worker from the average, then average everything
            replica = copy.deepcopy(local).train()
            opt = torch.optim.SGD(replica.parameters(), lr=LR)
            for s in span:
                x, y = batches.batch(s, w)
                opt.zero_grad()
                loss_fn(replica(x), y).backward()
                opt.step()
            replicas.append(replica.state_dict())
        local.load_state_dict(
            {
                name: torch.stack([rep[name].double() for rep in replicas]).mean(0).to(value.dtype)
                for name, value in local.state_dict().items()
            }
        )
        if (r + 1) % every == 0 or r + 1 == rounds:
            out["ist"].append((r + 1, _evaluate(list(ist), job)))
            out["data_parallel"].append((r + 1, _evaluate(list(dp), job)))
            out["local_sgd"].append((r + 1, _evaluate(list(local), job)))
    return out


def _markdown(width: int, epochs: int, results: dict[str, Any], command: str) -> str:
    lines = [
        f"# IST over real p2p daemons (loopback): wide_mlp 64-{width}-{width}-10, digits, {epochs} epochs",
        "",
        f"Batch 32, plain SGD lr {LR}, K = {LOCAL_STEPS} local steps per round; every worker trains on its own",
        "batch slots (the same slots the other modes use). Bytes are encoded `ist_pull` messages counted by the",
        "endpoints (what goes to the libp2p daemon), per worker per round, rounds 1.. (round 0 needs no entries:",
        "every worker built the same seed model). Data parallel / local SGD columns: a ring all-reduce of the",
        "same fp32 model, 2(n−1)/n × model per worker each way, per step (× K per round) or per round.",
        "",
        "| n | rounds | full model MB | IST received / worker / round MB (measured) | sub-network MB (closed form) | DP all-reduce / worker / round MB | local SGD / round MB | IST ÷ DP | final acc (network) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, res in results.items():
        t = res["traffic"]
        mean = sum(w["mean_round_bytes_received"] for w in res["workers"]) / len(res["workers"])
        acc = ", ".join(f"{w['eval_accuracy']:.3f}" for w in res["workers"])
        lines.append(
            f"| {n} | {res['rounds']} | {t['full_model_bytes'] / 1e6:.2f} | {mean / 1e6:.3f} | {t['subnetwork_bytes'] / 1e6:.3f} "
            f"| {t['dp_round_bytes'] / 1e6:.2f} | {t['local_sgd_round_bytes'] / 1e6:.2f} | {mean / t['dp_round_bytes']:.4f} | {acc} |"
        )
    lines += [
        "",
        "Accuracy vs rounds (in process, same batches; the networked IST equals the in-process one bit for bit):",
        "",
    ]
    for n, res in results.items():
        lines += [f"n = {n}:", "", "| round | IST | data parallel | local SGD |", "|---|---|---|---|"]
        for (r, a), (_, b), (_, c) in zip(
            *(res["curves"][k] for k in ("ist", "data_parallel", "local_sgd")), strict=True
        ):
            lines.append(f"| {r} | {a:.3f} | {b:.3f} | {c:.3f} |")
        lines.append("")
    lines += [f"Command: `{command}`.", ""]
    return "\n".join(lines)


def run(width: int, epochs: int, sizes: tuple[int, ...]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for n in sizes:
        net = asyncio.run(_network_run(n, width, epochs))
        job = net.pop("job")
        closed = ist_bytes_per_worker(64, (width, width), 10, n)
        model = closed.full_model_bytes
        ring = 2 * (n - 1) / n * model
        net["traffic"] = {
            "full_model_bytes": model,
            "subnetwork_bytes": closed.total_bytes,
            "expected_received_bytes": closed.total_bytes * (n - 1) / n,
            "dp_round_bytes": ring * LOCAL_STEPS,
            "local_sgd_round_bytes": ring,
        }
        every = max(1, net["rounds"] // 8)
        net["curves"] = _curves(job, n, net["steps_per_worker"], every)
        results[str(n)] = net
        print(
            n,
            json.dumps(net["traffic"]),
            [w["mean_round_bytes_received"] for w in net["workers"]],
            flush=True,
        )
    return results


def main(quick: bool = False, width: int | None = None, epochs: int | None = None) -> None:
    width = width or (512 if quick else 2048)
    epochs = epochs or (2 if quick else 8)
    command = (
        f"PYTHONPATH=src:. nice -n 10 python -m benchmarks.ist_network --width {width} --epochs {epochs}"
    )
    results = run(width, epochs, (2, 4))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ist_network.json").write_text(
        json.dumps({"width": width, "epochs": epochs, "results": results}, indent=1)
    )
    (RESULTS / "ist_network.md").write_text(_markdown(width, epochs, results, command))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    main(width=args.width, epochs=args.epochs)
