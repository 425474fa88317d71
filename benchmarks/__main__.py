"""`python -m benchmarks [name ...] [--quick]`: run the benchmarks (all by default) and index results."""

from __future__ import annotations

import argparse
import importlib
import sys

from benchmarks.harness import write_index

# Module names under benchmarks/, in the order `make bench` runs them. Each has `main(quick: bool) -> None`.
ALL = [
    "bench_placement",
    "bench_planner",
    "bench_planner_links",
    "bench_gossip",
    "bench_averaging",
    "bench_learning",
    "bench_pipeline_throughput",
    "bench_overlap",
    "ist_theory",
    "ist_inprocess",
    "ist_network",
    "backup_workers_sim",
    "bench_backup_lab",
    "bench_trust_cost",
]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {ALL})")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and smaller sizes")
    args = parser.parse_args()
    names = args.names or ALL
    failed = []
    for name in names:
        print(f"== {name}", flush=True)
        module = importlib.import_module(f"benchmarks.{name}")
        try:
            module.main(quick=args.quick)
        except Exception as exc:
            print(f"!! {name} failed: {exc!r}", file=sys.stderr, flush=True)
            failed.append(name)
    print(f"results index: {write_index()}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
