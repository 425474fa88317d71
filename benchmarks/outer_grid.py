"""The methods `bench_outer.py` compares, and running them (in worker processes, cached by run).

Every method is one `outer_sim.simulate` run per seed. Runs are cached in
benchmarks/results/outer_optimizer_runs.json keyed by (method name, seed, steps), so an interrupted grid
resumes and the report can be rewritten without rerunning.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.outer_sim import Method, Trace, make_problem, simulate
from ravnest_p2p.averaging import DeltaCompression, OuterOptimizerConfig

__all__ = ["OUTER_H", "PERIODS", "Grid", "codec_methods", "run_all", "tuning_methods"]

PERIODS = (16, 32, 64, 128, 256)
FP16_PERIODS = (32, 64, 96, 128, 160, 192, 256)
# plain averaging through the ring's 8-bit codecs (hivemind's; periodic's cheapest existing wire)
INT8_PERIODS = (64, 128, 192, 256)
PLAIN_8BIT = ("uniform8bit", "quantile8bit")
OUTER_H = (10, 50, 100, 200, 300, 400, 500)
# outer (lr, momentum) tried per H, DiLoCo's 0.7 / 0.9 first (the baseline); a lower momentum with lr 1
# keeps the first syncs of a long H from overshooting (session 9: H >= 300 needed it)
OUTER_GRID = ((0.7, 0.9), (1.0, 0.9), (0.5, 0.9), (0.7, 0.8), (1.0, 0.5))
# compressed Δ: the codecs, each with its settings (top-k: SparseLoCo-style, see pseudograd.py)
CODECS: dict[str, dict[str, object]] = {
    "int8": {"compression": DeltaCompression.INT8},
    "int4": {"compression": DeltaCompression.INT4},
    "topk": {  # SparseLoCo-style, with the unsent part kept in the weights (docs/sparse-delta.md)
        "compression": DeltaCompression.TOPK,
        "topk_fraction": 0.1,
        "topk_chunk": 4096,
        "topk_bits": 2,
        "unsent_stays_local": True,
    },
    "topk25": {  # a quarter of each chunk at 4 bits: top-k within 1 % of uncompressed at long H
        "compression": DeltaCompression.TOPK,
        "topk_fraction": 0.25,
        "topk_chunk": 4096,
        "topk_bits": 4,
        "unsent_stays_local": True,
    },
    "topk50": {  # half of each chunk at 4 bits
        "compression": DeltaCompression.TOPK,
        "topk_fraction": 0.5,
        "topk_chunk": 4096,
        "topk_bits": 4,
        "unsent_stays_local": True,
    },
    "topkef": {  # 10 % at 2 bits with the classic residual (re-sent from e) instead of kept in θ
        "compression": DeltaCompression.TOPK,
        "topk_fraction": 0.1,
        "topk_chunk": 4096,
        "topk_bits": 2,
        "unsent_stays_local": False,
    },
}


def outer_name(h: int, lr: float, momentum: float, codec: str = "none") -> str:
    suffix = "" if codec == "none" else f" {codec}"
    return f"outer H={h} lr={lr:g} mu={momentum:g}{suffix}"


def plain_methods() -> list[Method]:
    out = [Method("every step", 1)]
    out += [Method(f"periodic {p}", p) for p in PERIODS]
    out += [Method(f"periodic {p} fp16", p, fp16=True) for p in FP16_PERIODS]
    out += [Method(f"periodic {p} {c}", p, plain_codec=c) for c in PLAIN_8BIT for p in INT8_PERIODS]
    return out


def tuning_methods() -> list[Method]:
    """Uncompressed outer optimizer over the (lr, momentum) grid for every H."""
    return [
        Method(outer_name(h, lr, mu), h, OuterOptimizerConfig(lr=lr, momentum=mu))
        for h in OUTER_H
        for lr, mu in OUTER_GRID
    ]


def codec_methods(h: int, lr: float = 0.7, momentum: float = 0.9) -> list[Method]:
    """The codecs at H with (lr, momentum), unless a codec sets its own."""
    out = []
    for name, kw in CODECS.items():
        config = OuterOptimizerConfig.model_validate({"lr": lr, "momentum": momentum, **kw})
        out.append(Method(outer_name(h, config.lr, config.momentum, name), h, config))
    return out


@dataclass
class Grid:
    steps: int
    replicas: int
    hidden: int
    cache: Path

    def load(self) -> dict[str, dict[str, object]]:
        with open(self.cache.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # writers hold it exclusively
            return json.loads(self.cache.read_text()) if self.cache.exists() else {}

    def save(self, key: str, entry: dict[str, object]) -> None:
        """Add one run under a lock (two grids may share the cache)."""
        with open(self.cache.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            done = json.loads(self.cache.read_text()) if self.cache.exists() else {}
            done[key] = entry
            tmp = self.cache.with_suffix(".tmp")
            tmp.write_text(json.dumps(done))
            os.replace(tmp, self.cache)  # readers never see a half-written file

    def key(self, method: Method, seed: int) -> str:
        return f"{method.name}|seed={seed}|steps={self.steps}|R={self.replicas}|hidden={self.hidden}"

    def traces(self, methods: list[Method], seeds: list[int]) -> dict[tuple[str, int], Trace]:
        done = self.load()
        out = {}
        for m in methods:
            for s in seeds:
                entry = done.get(self.key(m, s))
                if entry is not None:
                    out[(m.name, s)] = Trace(**entry["trace"])  # type: ignore[arg-type]
        return out


def _one(args: tuple[Method, int, int, int, int, float]) -> tuple[str, int, dict[str, object], float] | None:
    method, seed, steps, replicas, hidden, stop_at = args
    if time.time() > stop_at:
        return None
    torch.set_num_threads(1)
    started = time.monotonic()
    problem = make_problem("char", hidden=hidden)
    trace = simulate(problem, method, num_replicas=replicas, num_steps=steps, seed=seed, eval_every=50)
    return method.name, seed, vars(trace), time.monotonic() - started


def run_all(grid: Grid, plan: list[tuple[Method, int]], workers: int, stop_at: float = float("inf")) -> None:
    """Run every (method, seed) of `plan` not in the cache yet, in order, `workers` at a time.

    The cache is saved after every run; no run starts after `stop_at` (time.time()).
    """
    done = grid.load()
    todo = [(m, s) for m, s in plan if grid.key(m, s) not in done]
    if not todo:
        return
    by_name = {m.name: m for m, _ in plan}
    jobs = [(m, s, grid.steps, grid.replicas, grid.hidden, stop_at) for m, s in todo]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for result in pool.imap_unordered(_one, jobs):
            if result is None:
                continue
            name, seed, trace, elapsed = result
            grid.save(grid.key(by_name[name], seed), {"trace": trace, "seconds": round(elapsed, 1)})
            loss = trace["val_loss"][-1]  # type: ignore[index]
            print(f"{name} seed {seed}: {loss:.4f} ({elapsed:.0f}s)", flush=True)
