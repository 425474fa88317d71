"""Synchronous SGD with backup workers vs without vs asynchronous SGD, in simulated time (one process).

`python -m benchmarks.backup_workers_sim` writes benchmarks/results/backup_workers_sim.md (seconds).

N = 4 workers aggregate per step; b backups are added (b = 0, 1, 2). Compute times are lognormal
(median 1 time unit, sigma 0.3); worker 0 is a persistent straggler (3x slower). Time is simulated (an
event queue; no sleeps), the gradients are real: a 64-32-10 MLP on scikit-learn digits, batch 32, plain
SGD, each worker sampling its own batches. The owners are the real `SyncBackupOwner` / `AsyncShardOwner`.
Sync: a worker whose gradient was counted waits for the step to complete; a dropped (late) worker restarts
at once on the current step. Async: every gradient is applied on arrival and the worker restarts at once.
"""

from __future__ import annotations

import heapq
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

from ravnest_p2p.strategies import AsyncShardOwner, SyncBackupOwner, Verdict

RESULTS = Path(__file__).parent / "results"
N = 4
LR = 0.1
BATCH = 32
HORIZON = 150.0  # simulated time units


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def run(num_backups: int | None, seed: int = 0) -> dict[str, object]:
    """num_backups=None runs the asynchronous baseline with N workers."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    x_tr, y_tr, x_te, y_te = x[:1400], y[:1400], x[1400:], y[1400:]
    num_workers = N + (num_backups or 0)
    workers = [f"w{i}" for i in range(num_workers)]
    model = _model()
    init = {k: v.detach() for k, v in model.named_parameters()}
    owner: SyncBackupOwner | AsyncShardOwner
    if num_backups is None:
        owner = AsyncShardOwner(init, workers, lr=LR)
    else:
        owner = SyncBackupOwner(init, workers, N, lr=LR)
    rng = np.random.default_rng(seed)
    batch_rngs = [torch.Generator().manual_seed(seed * 100 + i) for i in range(num_workers)]
    events: list[tuple[float, int, int, dict[str, torch.Tensor]]] = []

    def start(worker: int, now: float) -> None:
        params, step = owner.parameters(), owner.step
        model.load_state_dict(params)
        idx = torch.randint(0, len(x_tr), (BATCH,), generator=batch_rngs[worker])
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        compute = float(rng.lognormal(0.0, 0.3)) * (3.0 if worker == 0 else 1.0)
        heapq.heappush(events, (now + compute, worker, step, grads))

    for w in range(num_workers):
        start(w, 0.0)
    waiting: list[int] = []
    step_times: list[float] = []
    last_step_at = 0.0
    contributions = [0] * num_workers
    while events:
        now, worker, step, grads = heapq.heappop(events)
        if now > HORIZON:
            break
        verdict = owner.submit(workers[worker], step, grads).verdict
        if verdict in (Verdict.ACCEPTED, Verdict.APPLIED):
            contributions[worker] += 1
        if num_backups is None or verdict not in (Verdict.ACCEPTED, Verdict.APPLIED):
            start(worker, now)
        elif verdict is Verdict.ACCEPTED:
            waiting.append(worker)
        else:  # this gradient completed the step: release everyone who waited
            step_times.append(now - last_step_at)
            last_step_at = now
            for w in [*waiting, worker]:
                start(w, now)
            waiting = []
    model.load_state_dict(owner.parameters())
    with torch.no_grad():
        accuracy = float((model(x_te).argmax(1) == y_te).float().mean())
    out: dict[str, object] = {"updates": owner.step, "accuracy": accuracy, "contributions": contributions}
    if isinstance(owner, SyncBackupOwner):
        out["mean_step"] = float(np.mean(step_times)) if step_times else float("nan")
        out["dropped_late"] = owner.aggregator.dropped[Verdict.LATE]
    else:
        out["staleness"] = dict(sorted(owner.staleness_histogram.items()))
    return out


def main(quick: bool = False) -> None:
    torch.set_num_threads(1)
    lines = [
        f"# Sync SGD with backup workers vs async, simulated time ({HORIZON:.0f} units), digits MLP",
        "",
        f"N = {N} gradients per step; compute times lognormal (median 1, sigma 0.3), worker w0 3x slower; "
        f"batch {BATCH}, SGD lr {LR}; one seed. Sync steps average N gradients; async applies each "
        "one.",
        "",
        "| mode | updates applied | mean step time | test acc | gradients counted per worker "
        "| dropped / staleness |",
        "|---|---|---|---|---|---|",
    ]
    for label, b in (("sync, b = 0", 0), ("sync, b = 1", 1), ("sync, b = 2", 2), ("async (N workers)", None)):
        r = run(b)
        step = f"{r['mean_step']:.2f}" if "mean_step" in r else "-"
        extra = (
            f"{r['dropped_late']} late dropped"
            if "dropped_late" in r
            else f"staleness histogram {r['staleness']}"
        )
        lines.append(
            f"| {label} | {r['updates']} | {step} | {r['accuracy']:.3f} | {r['contributions']} | {extra} |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        "Reading: one backup removes the straggler from the critical path (the mean step time falls from "
        "the straggler's ~3 units towards the 4th order statistic of the fast workers), so more steps fit "
        "in the same time; the straggler's gradients are all dropped, never applied. Async makes ~N times "
        "more (single-gradient) updates at the same lr and, on this small, shallow problem, reaches a "
        "higher accuracy in the same time despite staleness up to 16: the accuracy advantage of sync + "
        "backups that Chen et al. report is for deep models (Inception on ImageNet) and is not reproduced "
        "by this toy. It measures the mechanics, not that claim.",
        "",
        "Command: `PYTHONPATH=src:. nice -n 19 python -m benchmarks.backup_workers_sim`.",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "backup_workers_sim.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
