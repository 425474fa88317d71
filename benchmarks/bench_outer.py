"""Bytes to a target loss: plain averaging (every step, periodic) vs the outer optimizer (DiLoCo).

`python -m benchmarks.bench_outer [--steps 1500] [--replicas 4] [--hidden 128] [--seeds 0,1] [--workers 3]`
writes benchmarks/results/outer_optimizer.{md,json,png}. One process per run, several replicas
(clusters) of a character MLP on pydoc_data text (`outer_sim.py`; rings simulated by plain means).

1. Plain averaging: every step, periodic over a grid of periods (fp32, the ring's fp16 and its 8-bit
   codecs), all seeds.
2. Outer optimizer, uncompressed, per H: a grid of (outer lr, momentum), DiLoCo's 0.7 / 0.9 first; the
   best final loss at each H (first seed) is chosen and rerun on the other seeds.
3. Compressed Δ (int8, int4, top-k) at each H with that H's chosen (lr, momentum), all seeds.

The target, per seed: the validation loss averaging after every step reaches at the token budget
(`--steps` inner steps per replica). Bytes to target: bytes per replica until the first evaluation at
or below it; a method reaches the target only if it does for every seed, and its figure is the largest
over the seeds (the worst case). Runs are cached (`outer_grid.py`): rerunning resumes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

from benchmarks.outer_grid import (
    OUTER_H,
    Grid,
    codec_methods,
    outer_name,
    plain_methods,
    run_all,
    tuning_methods,
)
from benchmarks.outer_report import markdown, plot
from benchmarks.outer_sim import Method, Trace

RESULTS = Path(__file__).parent / "results"


def _first_at(trace: Trace, target: float) -> int | None:
    return next((i for i, loss in enumerate(trace.val_loss) if loss <= target), None)


def row(method: Method, runs: dict[int, Trace], every: dict[int, Trace]) -> dict[str, object]:
    """One method over its seeds, against every-step averaging of the same seed."""
    finals = [runs[s].val_loss[-1] for s in runs]
    ratios = [runs[s].val_loss[-1] / every[s].val_loss[-1] for s in runs]
    to_target, to_2pct = [], []
    for s, trace in runs.items():
        target = every[s].val_loss[-1]
        hit, hit2 = _first_at(trace, target), _first_at(trace, target * 1.02)
        to_target.append(None if hit is None else trace.would_be_bytes[hit])
        to_2pct.append(None if hit2 is None else trace.would_be_bytes[hit2])
    first = next(iter(runs.values()))
    c = method.outer
    return {
        "method": method.name,
        "period": method.period,
        "compression": "fp16" if method.fp16 else (c.compression.value if c else method.plain_codec or "-"),
        "seeds": len(runs),
        "final_val_loss": round(statistics.fmean(finals), 4),
        "final_spread": round(max(finals) - min(finals), 4),
        "finals_per_seed": [round(f, 4) for f in finals],
        "final_vs_every_step": round(statistics.fmean(ratios), 4),
        "final_vs_every_step_worst": round(max(ratios), 4),
        "bytes_per_sync": first.would_be_per_sync,
        "bytes_to_target": None if None in to_target else max(b for b in to_target if b is not None),
        "bytes_to_target_per_seed": to_target,
        "bytes_to_within_2pct": None if None in to_2pct else max(b for b in to_2pct if b is not None),
    }


def _by_name(methods: list[Method]) -> dict[str, Method]:
    return {m.name: m for m in methods}


def plan(
    seeds: list[int], only_codec: str = "", chosen: dict[int, tuple[float, float]] | None = None
) -> list[tuple[Method, int]]:
    """The runs, most wanted first (a run that cannot start before --stop-at is left out)."""
    plain = _by_name(plain_methods())
    tuning = _by_name(tuning_methods())
    codecs = {h: _by_name(codec_methods(h)) for h in OUTER_H}

    def outer(h: int, codec: str) -> Method:
        if codec == "none":
            return tuning[f"outer H={h} lr=0.7 mu=0.9"]
        return next(m for n, m in codecs[h].items() if n.endswith(f" {codec}"))

    if only_codec == "chosen":  # the codecs (and seeds) at each H's tuned (lr, momentum)
        out = []
        for h, (lr, mu) in (chosen or {}).items():
            if (lr, mu) != (0.7, 0.9):
                out += [(tuning[outer_name(h, lr, mu)], s) for s in seeds[1:]]
                out += [(m, s) for s in seeds for m in codec_methods(h, lr, mu)]
        return out
    if only_codec.startswith("periodic"):  # e.g. "periodic 256;periodic 128 fp16"
        return [(plain[n], s) for n in only_codec.split(";") for s in seeds]
    if only_codec:
        return [(outer(h, only_codec), s) for h in OUTER_H for s in seeds]
    first, rest = seeds[0], seeds[1:]
    second = rest[0] if rest else first
    # what the headline comparison needs first, on both seeds; then the rest of the grid
    out = [(plain["every step"], second), (plain["periodic 32"], first), (plain["periodic 64 fp16"], first)]
    out += [(plain["periodic 64"], second), (outer(50, "int4"), second), (outer(50, "none"), second)]
    out += [(outer(100, c), first) for c in ("none", "int4")]
    out += [(plain["periodic 128"], first), (plain["periodic 32"], second)]
    out += [(plain["periodic 64 fp16"], second)]
    out += [(outer(100, c), second) for c in ("none", "int4")]
    out += [(outer(50, "int8"), second), (outer(100, "int8"), first), (plain["periodic 16"], second)]
    for s in rest:
        out += [(outer(h, c), s) for h in (200, 10) for c in ("none", "int4", "int8")]
        out += [(outer(100, "int8"), s), (plain["periodic 32 fp16"], s), (plain["periodic 128"], s)]
    out += [(plain["periodic 32 fp16"], first)]
    # session 9: the longer H, the plain codecs and periods added since (cached runs are skipped)
    codecs_all = ("none", "int4", "int8", "topk")
    out += [(outer(h, c), s) for h in (500, 400, 300) for s in seeds for c in codecs_all]
    out += [(m, s) for m in plain.values() for s in seeds]
    # the tuning grid last
    out += [(m, first) for h in sorted(OUTER_H, reverse=True) for m in tuning.values() if m.period == h]
    return [(m, s) for m, s in out if m.period in OUTER_H or m.outer is None]


def _chosen(rows: dict[str, dict[str, object]], h: int) -> tuple[float, float]:
    """The (lr, momentum) of the best uncompressed final loss at H (first seed; among runs done)."""
    candidates = [m for m in tuning_methods() if m.period == h and m.name in rows]
    if not candidates:
        return 0.7, 0.9
    best = min(candidates, key=lambda m: float(rows[m.name]["final_val_loss"]))  # type: ignore[arg-type]
    assert best.outer is not None
    return best.outer.lr, best.outer.momentum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--stop-at", default="", help="HH:MM UTC: start no run after it")
    parser.add_argument("--only-codec", default="", help="run only this codec's outer runs (e.g. topk)")
    parser.add_argument("--rewrite", action="store_true", help="only the report, from cached runs")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    grid = Grid(args.steps, args.replicas, args.hidden, RESULTS / "outer_optimizer_runs.json")
    if not args.rewrite:
        stop_at = float("inf")
        if args.stop_at:
            now = datetime.datetime.now(datetime.UTC)
            hh, mm = (int(x) for x in args.stop_at.split(":"))
            stop_at = now.replace(hour=hh, minute=mm, second=0).timestamp()
        tuned = _tuned(grid, seeds)
        chosen = {h: _chosen(tuned, h) for h in OUTER_H}
        run_all(grid, plan(seeds, args.only_codec, chosen), args.workers, stop_at)
        if args.only_codec:
            return
    report(grid, seeds, args)


def _tuned(grid: Grid, seeds: list[int]) -> dict[str, dict[str, object]]:
    every = {s: t for (_, s), t in grid.traces(plain_methods()[:1], seeds[:1]).items()}
    traces = grid.traces(tuning_methods(), seeds[:1])
    return {
        name: row(next(m for m in tuning_methods() if m.name == name), {s: t}, every)
        for (name, s), t in traces.items()
    }


def report(grid: Grid, seeds: list[int], args: argparse.Namespace) -> None:
    plain, tuning = plain_methods(), tuning_methods()
    tuned0 = _tuned(grid, seeds)
    finals = []
    for h in OUTER_H:
        lr, mu = _chosen(tuned0, h)
        keep = {outer_name(h, 0.7, 0.9), outer_name(h, lr, mu)}  # DiLoCo's defaults and the chosen
        finals += [t for t in tuning if t.name in keep] + codec_methods(h)
        if (lr, mu) != (0.7, 0.9):
            finals += [m for m in codec_methods(h, lr, mu)]
    every = {s: t for (_, s), t in grid.traces(plain[:1], seeds).items()}
    use = [s for s in seeds if s in every]

    def rows_of(methods: list[Method], on: list[int]) -> dict[str, dict[str, object]]:
        traces = grid.traces(methods, on)
        out = {}
        for m in methods:
            runs = {s: traces[(m.name, s)] for s in on if (m.name, s) in traces}
            if runs:
                out[m.name] = row(m, runs, every)
        return out

    tuned = rows_of(tuning, use[:1])
    chosen = {h: _chosen(tuned, h) for h in OUTER_H}
    rows = list(rows_of(plain, use).values()) + list(rows_of(finals, use).values())
    best_periodic = min(
        (r for r in rows if str(r["method"]).startswith("periodic")),
        key=lambda r: float(r["bytes_to_target"] or "inf"),  # type: ignore[arg-type]
    )["method"]
    show = {"every step", "periodic 64", "periodic 128", "periodic 128 uniform8bit", str(best_periodic)}
    for h in (50, 200, 400, 500):
        lr, mu = chosen[h]
        show |= {outer_name(h, lr, mu), outer_name(h, lr, mu, "int4")}
    show |= {outer_name(100, *chosen[100], "topk"), outer_name(500, *chosen[500], "int8")}
    payload = {
        "args": vars(args),
        "plot_methods": sorted(show),
        "chosen_lr_momentum": {str(h): v for h, v in chosen.items()},
        "best_periodic": best_periodic,
        "tuning": list(tuned.values()),
        "rows": rows,
        "traces_seed0": {name: vars(t) for (name, _), t in grid.traces(plain + finals, use[:1]).items()},
    }
    (RESULTS / "outer_optimizer.json").write_text(json.dumps(payload, indent=1))
    (RESULTS / "outer_optimizer.md").write_text(markdown(payload))
    plot(payload, RESULTS / "outer_optimizer.png")


if __name__ == "__main__":
    main()
