"""Benchmarks: each module has `run(quick: bool) -> list[dict]` and writes results via `harness.record`."""
