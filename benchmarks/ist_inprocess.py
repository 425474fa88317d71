# ruff: noqa: RUF001, E501  (result text and plot labels use math notation; its long lines are prose)
"""IST in one process on scikit-learn's digits: full-model SGD vs IST (n = 2, 4) at equal epochs.

`python -m benchmarks.ist_inprocess [--width 2048] [--epochs 8]` writes benchmarks/results/ist_inprocess.md.
Each epoch every training sample is seen once: full-model SGD takes all batches; IST deals the batches of
an epoch to the n simulated workers (each worker's own shard of the data), K local steps per round.
Evaluated on the full (written-back) model, with the BatchNorm statistics as written back and after
re-estimating them on the training set (`recalibrate_batchnorm`). Scaling rules compared at n = 4.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import Tensor, nn

from ravnest_p2p.models import build_model, make_loss
from ravnest_p2p.strategies import ScaleRule, eval_layers, recalibrate_batchnorm, train_ist_round

RESULTS = Path(__file__).parent / "results"
BATCH = 32
LR = 0.05
LOCAL_STEPS = 5


def _data() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def _evaluate(layers: list[nn.Module], x: Tensor, y: Tensor) -> tuple[float, float]:
    model = nn.Sequential(*layers).eval()
    with torch.no_grad():
        out = model(x)
    return float((out.argmax(1) == y).float().mean()), float(nn.functional.cross_entropy(out, y))


def _batches(x: Tensor, y: Tensor, epoch: int) -> list[tuple[Tensor, Tensor]]:
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(100 + epoch))
    return [(x[perm[i : i + BATCH]], y[perm[i : i + BATCH]]) for i in range(0, len(x) - BATCH + 1, BATCH)]


def run(
    width: int, epochs: int, num_workers: int, rule: ScaleRule, data: tuple[Tensor, ...]
) -> dict[str, float]:
    x_tr, y_tr, x_te, y_te = data
    config = {"in_features": 64, "hidden_features": [width, width], "out_features": 10}
    layers = build_model("wide_mlp", config, seed=0)
    loss_fn = make_loss("cross_entropy")
    start = time.process_time()
    if num_workers == 0:
        model = nn.Sequential(*layers).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for epoch in range(epochs):
            for xb, yb in _batches(x_tr, y_tr, epoch):
                optimizer.zero_grad()
                loss_fn(model(xb), yb).backward()
                optimizer.step()
    else:
        shard = len(x_tr) // num_workers
        shards = [
            (x_tr[i * shard : (i + 1) * shard], y_tr[i * shard : (i + 1) * shard]) for i in range(num_workers)
        ]
        round_index = 0
        for epoch in range(epochs):
            per_worker = [_batches(xs, ys, epoch) for xs, ys in shards]
            steps = min(len(b) for b in per_worker)
            for k in range(0, steps, LOCAL_STEPS):
                work = [b[k : k + LOCAL_STEPS] for b in per_worker]
                train_ist_round(
                    layers, work, round_index=round_index, seed=0, lr=LR, loss_fn=loss_fn, scale_rule=rule
                )
                round_index += 1
    cpu_s = time.process_time() - start
    n = max(num_workers, 1)
    acc, loss = _evaluate(eval_layers(layers, n, rule), x_te, y_te)
    recalibrate_batchnorm(
        nn.Sequential(*eval_layers(layers, n, rule)), [b[0] for b in _batches(x_tr, y_tr, 999)]
    )
    acc_r, loss_r = _evaluate(eval_layers(layers, n, rule), x_te, y_te)
    return {"acc": acc, "loss": loss, "acc_recal": acc_r, "loss_recal": loss_r, "cpu_s": cpu_s}


def main(quick: bool = False, width: int = 2048, epochs: int = 8) -> None:
    torch.set_num_threads(1)
    data = _data()
    if quick:
        width, epochs = 256, 4
    runs = [
        ("full model (SGD)", 0, ScaleRule.TRAIN),
        ("IST n=2, n× at train", 2, ScaleRule.TRAIN),
        ("IST n=4, n× at train", 4, ScaleRule.TRAIN),
        ("IST n=8, n× at train", 8, ScaleRule.TRAIN),
        ("IST n=4, 1/n at test (ResIST)", 4, ScaleRule.TEST),
        ("IST n=4, no scaling", 4, ScaleRule.NONE),
    ]
    rows = []
    for label, n, rule in runs:
        r = run(width, epochs, n, rule, data)
        rows.append(
            f"| {label} | {r['acc']:.3f} | {r['loss']:.3f} | {r['acc_recal']:.3f} | {r['loss_recal']:.3f} "
            f"| {r['cpu_s']:.1f} |"
        )
        print(rows[-1], flush=True)
    lines = [
        f"# IST in process: scikit-learn digits, wide_mlp 64-{width}-{width}-10 (BatchNorm), {epochs} epochs",
        "",
        f"Batch {BATCH}, plain SGD lr {LR}, IST K = {LOCAL_STEPS} local steps per round, each worker on "
        f"its own 1/n of the {len(data[0])} training samples; test set {len(data[2])} samples. One seed. "
        "One thread, niced, on a shared loaded host (CPU seconds are indicative only). Test metrics on the "
        "full written-back model: as written back, then after re-estimating BatchNorm statistics on the "
        "training set.",
        "",
        "| run | test acc | test loss | test acc (BN recal.) | test loss (BN recal.) | train CPU s |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Command: `PYTHONPATH=src:. nice -n 19 python -m benchmarks.ist_inprocess --width {width} --epochs {epochs}`.",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ist_inprocess.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    main(quick=args.quick, width=args.width, epochs=args.epochs)
