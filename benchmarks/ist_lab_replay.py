"""Accuracy after every sync of the `bench_ist_lab` jobs, replayed in process on the same batches.

The lab runs measure time and bytes; evaluating the model inside the workers after every step would
cost them time (and an IST model exists whole only after a gather). All three modes are deterministic
functions of the job (seed, batch slots), so the benchmark replays them here and takes the accuracy
after sync i from the replay and the time of sync i from the lab:

- IST: `train_ist_round` on each worker's K batches (the networked IST equals it bit for bit,
  tests/unit/training/test_ist_network.py);
- data parallel and local SGD: n worker models, each pushing what the sync_backup worker pushes
  (`training.sync_compute.step_push`: a gradient, or K local SGD steps' pseudo-gradient); the mean is
  applied with plain SGD, as the owners do; BatchNorm running statistics stay per worker, and worker
  0's model is evaluated (tests/unit/training/test_sync_local.py checks the same arithmetic over the
  transport).

The lab's final held-out accuracy is reported beside the replay's last point as the check.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch import nn

from ravnest_p2p.models import build_model, make_loss
from ravnest_p2p.strategies import train_ist_round
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.stages import load_dataset
from ravnest_p2p.training.sync_compute import step_push
from ravnest_p2p.training.sync_report import evaluate
from ravnest_p2p.training.sync_shard import SyncBatches, sync_final_step

__all__ = ["cached_replays", "replay", "replay_all"]


def replay(job: JobSpec, mode: str, n: int, k: int) -> list[tuple[int, float]]:
    """(syncs done, held-out accuracy) every K data steps and at the end (a sync: IST round, DP step, local
    SGD average; K data steps are one IST round, one local SGD sync and K DP steps)."""
    torch.manual_seed(job.seed)
    train, held_out = load_dataset(job)
    batches = SyncBatches(train, batch_size=job.batch_size, seed=job.seed, num_workers=n)
    data_steps = sync_final_step(
        len(train),
        batch_size=job.batch_size,
        num_workers=n,
        num_epochs=job.num_epochs,
        max_steps=job.max_steps,
    )
    loss_fn = make_loss("cross_entropy")
    lr = job.optimizer.lr
    out = []
    if mode == "ist":
        layers = build_model(job.model, job.model_params, seed=job.seed)
        for r in range(math.ceil(data_steps / k)):
            span = range(r * k, min(data_steps, (r + 1) * k))
            train_ist_round(
                layers,
                [[batches.batch(s, w) for s in span] for w in range(n)],
                round_index=r,
                seed=job.seed,
                lr=lr,
                loss_fn=loss_fn,
            )
            out.append((r + 1, evaluate(nn.Sequential(*layers), held_out, loss_fn, job.eval_batch_size)[1]))
        return out
    local_steps = k if mode == "local" else 1
    models = [nn.Sequential(*build_model(job.model, job.model_params, seed=job.seed)) for _ in range(n)]
    params = [dict(m.named_parameters()) for m in models]
    pieces = [{name: p.detach() for name, p in ps.items()} for ps in params]
    num_syncs = math.ceil(data_steps / local_steps)
    every = k // local_steps
    for step in range(num_syncs):
        pushes = [
            step_push(
                models[w],
                params[w],
                pieces[w],
                batches=batches,
                loss_fn=loss_fn,
                worker=w,
                step=step,
                local_steps=local_steps,
                num_data_steps=data_steps,
                optimizer=job.optimizer,
            )[1]
            for w in range(n)
        ]
        with torch.no_grad():
            for name in pieces[0]:
                mean = torch.stack([push[name] for push in pushes]).mean(0)
                for w in range(n):
                    pieces[w][name].add_(mean, alpha=-lr)
        if (step + 1) % every == 0 or step + 1 == num_syncs:
            out.append((step + 1, evaluate(models[0], held_out, loss_fn, job.eval_batch_size)[1]))
    return out


Curves = dict[str, list[tuple[int, float]]]


def replay_all(job: JobSpec, modes: list[str], sizes: list[int], k: int) -> Curves:
    """`replay` of every mode and worker count, keyed ``mode/n``."""
    return {f"{mode}/{n}": replay(job, mode, n, k) for n in sizes for mode in modes}


def cached_replays(job: JobSpec, modes: list[str], sizes: list[int], k: int, cache: Path | None) -> Curves:
    """`replay_all`, read from `cache` when it holds the same job and K (else computed and written)."""
    key = {"job": json.loads(job.model_dump_json()), "k": k}
    if cache is not None and cache.exists():
        stored = json.loads(cache.read_text())
        curves = stored["curves"]
        if stored["key"] == key and all(f"{m}/{n}" in curves for m in modes for n in sizes):
            return {name: [(int(s), float(a)) for s, a in points] for name, points in curves.items()}
    curves = replay_all(job, modes, sizes, k)
    if cache is not None:
        cache.write_text(json.dumps({"key": key, "curves": curves}))
    return curves


def main() -> None:
    """Precompute the replays of `bench_ist_lab`'s job into a cache file (``--replay-cache`` there)."""
    from benchmarks.bench_ist_lab import LOCAL_STEPS, bench_job

    parser = argparse.ArgumentParser(prog="python -m benchmarks.ist_lab_replay")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cached_replays(
        bench_job(args.width, args.epochs), ["ist", "dp", "local"], args.sizes, LOCAL_STEPS, args.out
    )


if __name__ == "__main__":
    main()
