"""The run's fixed DHT key names, each with its maximum TTL, maximum value size and optional schema.

Why a registry: hivemind stores a key under ``DHTID.generate(source=key)``, a hash, so a record
validator (see `discovery.validator`) can only recognise the names it can enumerate and hash in
advance. Every run key is therefore ``ravnest/<run_id>/<name>`` with a fixed ``name``; what used to be
in the name (an epoch, a job id) travels inside the value.

Schemas of values defined above this layer (`JobSpec`, `StageMetrics`, the plan board's record, ...)
cannot be imported here: the composition root (`node.py`, and the client and status tools) registers
them with `KeyRegistry.with_schema`. A name with no schema is still checked for being a signed map with
an integer ``schema_version``, for its size and for its expiry.

Freshness: a value that says when it was written (``updated_at``, DHT time) must not lie in the future
(beyond `MAX_CLOCK_SKEW_S`) nor further back than its key's maximum TTL. The validator refuses such
values on store, and readers drop them (`is_fresh`), so a record kept alive by a far expiry, or
published with a clock set ahead, is never planned with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "DEFAULT_KEYS",
    "MAX_CLOCK_SKEW_S",
    "KeyRegistry",
    "KeySpec",
    "Schema",
    "is_fresh",
]

MAX_CLOCK_SKEW_S = 30.0  # how far ahead of our clock a writer's `updated_at` (or a TTL) may run

Schema = Callable[[Any, str], object]
"""Checks a decoded value written by the signer with the given peer id; raises (any exception) if bad."""


@dataclass(frozen=True)
class KeySpec:
    """One fixed run key name.

    Attributes:
        name: the name after ``ravnest/<run_id>/``.
        max_ttl_s: the furthest a stored value may expire after it is stored (and after its
            ``updated_at``).
        max_value_bytes: largest serialized value (the signature not counted).
        schema: validates the decoded value given the signer's peer id; None: only the generic checks.
        owner_only: only the run owner's signed subkey may hold a value (when the run has an owner).
    """

    name: str
    max_ttl_s: float
    max_value_bytes: int
    schema: Schema | None = None
    owner_only: bool = False


_HOUR_S = 3600.0
_DAY_S = 24 * _HOUR_S

DEFAULT_KEYS: tuple[KeySpec, ...] = (
    KeySpec("peers", max_ttl_s=600.0, max_value_bytes=16 * 1024),
    KeySpec("job", max_ttl_s=_DAY_S, max_value_bytes=256 * 1024),
    KeySpec("owners", max_ttl_s=7 * _DAY_S, max_value_bytes=64 * 1024, owner_only=True),
    KeySpec("plan", max_ttl_s=_HOUR_S, max_value_bytes=4 * 1024),
    KeySpec("metrics", max_ttl_s=_DAY_S, max_value_bytes=256 * 1024),
    KeySpec("progress", max_ttl_s=7 * _DAY_S, max_value_bytes=64 * 1024),
    KeySpec("checkpoints", max_ttl_s=30 * _DAY_S, max_value_bytes=256 * 1024),
    KeySpec("suspects", max_ttl_s=_HOUR_S, max_value_bytes=32 * 1024),
)


class KeyRegistry(Mapping[str, KeySpec]):
    """An immutable name -> `KeySpec` table; `with_schema` returns a copy with one schema set."""

    def __init__(self, specs: tuple[KeySpec, ...] = DEFAULT_KEYS) -> None:
        self._specs = {s.name: s for s in specs}
        for spec in specs:
            if not (spec.max_ttl_s > 0 and spec.max_value_bytes > 0) or "/" in spec.name:
                raise ValueError(f"bad key spec {spec}")

    def __getitem__(self, name: str) -> KeySpec:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def with_schema(self, name: str, schema: Schema) -> KeyRegistry:
        """A copy in which the values of `name` must pass `schema` (the name must be registered)."""
        if name not in self._specs:
            raise KeyError(f"unknown run key name {name!r}")
        return KeyRegistry(
            tuple(replace(s, schema=schema) if s.name == name else s for s in self._specs.values())
        )

    def with_key(self, spec: KeySpec) -> KeyRegistry:
        """A copy with `spec` added (or replacing the spec of the same name)."""
        return KeyRegistry((*(s for s in self._specs.values() if s.name != spec.name), spec))


def is_fresh(value: Any, max_ttl_s: float, now: float) -> bool:
    """False if `value` is a map whose ``updated_at`` is in the future or older than `max_ttl_s`.

    Values without an ``updated_at`` are fresh (their expiry is capped instead); a non-numeric or
    non-finite ``updated_at`` is not.
    """
    if not isinstance(value, dict) or "updated_at" not in value:
        return True
    updated_at = value["updated_at"]
    if (
        isinstance(updated_at, bool)
        or not isinstance(updated_at, int | float)
        or not math.isfinite(updated_at)
    ):
        return False
    return now - max_ttl_s - MAX_CLOCK_SKEW_S <= updated_at <= now + MAX_CLOCK_SKEW_S
