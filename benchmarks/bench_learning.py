"""Learning: an asynchronous 3-stage pipeline (real p2p daemons) vs single-process training, equal samples.

Both train the same model from the same initial weights on the same batches in the same order; the
pipeline runs with the default window, `max_in_flight = 3S - 2 = 7` (so its gradients are up to 6 weight
versions stale, with weight stashing) and the single process with none. Reported: held-out accuracy
(digits CNN) and held-out loss (char-level GPT on CPython's pydoc topics), and the peak RSS of this
process as a coarse memory figure.
"""

from __future__ import annotations

import asyncio
import resource
import time
from typing import Any

import torch

from benchmarks.harness import record
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.runtime.service import default_window
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.local import local_hosts, local_pipeline
from ravnest_p2p.training.stages import build_stage, load_dataset, num_layers, train_batches

# the runtime's default for 3 stages (3S - 2): gradients up to 6 weight versions stale, with stashing
WINDOW = default_window(3)


def _single(job: JobSpec) -> tuple[float, float, float]:
    train, held_out = load_dataset(job)
    stage = build_stage(job, 0, num_layers(job), max_in_flight=1)
    start = time.perf_counter()
    for mb, (x, y) in enumerate(train_batches(job, train, cluster_index=0, num_clusters=1)):
        stage.forward_loss(mb, x, y)
    elapsed = time.perf_counter() - start
    loss, acc = _evaluate(stage, held_out.inputs, held_out.labels, job)
    return loss, acc, elapsed


def _evaluate(stage: Any, inputs: torch.Tensor, labels: torch.Tensor, job: JobSpec) -> tuple[float, float]:
    from ravnest_p2p.models.spec import make_loss

    loss_fn = make_loss("cross_entropy")
    total_loss, correct, n, targets = 0.0, 0, 0, 0
    for i in range(0, len(inputs), job.eval_batch_size):
        x, y = inputs[i : i + job.eval_batch_size], labels[i : i + job.eval_batch_size]
        out = stage.predict(x)
        total_loss += float(loss_fn(out, y)) * y.shape[0]
        correct += int((out.argmax(-1) == y).sum())
        n += y.shape[0]
        targets += y.numel()
    return total_loss / n, correct / targets


async def _pipeline(job: JobSpec, num_stages: int, max_in_flight: int) -> tuple[float, float, float]:
    train, held_out = load_dataset(job)
    async with (
        local_hosts(num_stages) as transports,
        local_pipeline(job, transports, max_in_flight=max_in_flight) as services,
    ):
        start = time.perf_counter()
        await services[0].train(train_batches(job, train, cluster_index=0, num_clusters=1))
        elapsed = time.perf_counter() - start
        batches = [
            (held_out.inputs[i : i + job.eval_batch_size], held_out.labels[i : i + job.eval_batch_size])
            for i in range(0, len(held_out), job.eval_batch_size)
        ]
        loss, acc = await services[0].evaluate(batches)
        await services[0].finish()
    return loss, acc, elapsed


def main(quick: bool = False) -> None:
    rows = []
    digits = JobSpec(
        job_id="digits",
        model="digits_cnn",
        dataset="digits",
        batch_size=32,
        num_epochs=4 if quick else 10,
        seed=0,
        optimizer=OptimizerConfig(name="adam", lr=3e-3),
    )
    gpt = JobSpec(
        job_id="chargpt",
        model="char_gpt",
        model_params={"block_size": 64, "num_layers": 2, "embed_dim": 64, "num_heads": 2},
        dataset="char_corpus",
        dataset_config={"block_size": 64},
        batch_size=32,
        num_epochs=1,
        max_steps=150 if quick else 600,
        seed=0,
        optimizer=OptimizerConfig(
            name="adamw",
            lr=3e-3,
            schedule="warmup_cosine",
            warmup_steps=60 if not quick else 15,
            total_steps=600 if not quick else 150,
            min_lr_ratio=0.1,
        ),
        eval_batch_size=128,
    )
    for job in (digits, gpt):
        s_loss, s_acc, s_time = _single(job)
        p_loss, p_acc, p_time = asyncio.run(_pipeline(job, num_stages=3, max_in_flight=WINDOW))
        row = {
            "model": job.model,
            "samples": job.batch_size
            * sum(1 for _ in train_batches(job, load_dataset(job)[0], cluster_index=0, num_clusters=1)),
            "single_loss": s_loss,
            "pipeline_loss": p_loss,
            "loss_ratio": p_loss / s_loss,
            "single_acc": s_acc,
            "pipeline_acc": p_acc,
            "acc_diff_points": 100 * (p_acc - s_acc),
            "single_s": s_time,
            "pipeline_s": p_time,
        }
        print(row, flush=True)
        rows.append(row)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    record(
        "learning",
        rows,
        notes=" ".join(
            [
                f"Async 3-stage pipeline (max_in_flight={WINDOW}, the default; weight stashing, real p2p",
                "daemons on loopback, one process) vs single-process training on the same batches.",
                "Goals: digits accuracy >= 97% and within 0.5 point of single-process;",
                "char-GPT held-out loss within 5% (loss_ratio <= 1.05).",
                f"Peak RSS of the benchmark process: {peak_rss_mb:.0f} MB. Times are not a throughput",
                "measure (all stages share one compute thread here; see the throughput benchmark).",
            ]
        ),
    )


if __name__ == "__main__":
    main()
