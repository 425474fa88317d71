"""Which Δ codec a ring uses, from the rate of its slowest link (pure).

Problem. One codec per job wastes either bytes or accuracy when the rings run over very different
links: a ring between two data centres can afford fp32 Δ, one through a 25 Mbit/s home uplink wants
int4. The job's `OuterOptimizerConfig.codec_by_link_mbps` is a table of (below_mbps, codec) rows in
increasing order; a ring whose slowest member link (min over members of min(upload, download)) is below
a row's rate uses the first such row's codec, a faster ring (or one whose rates are unknown) the job's
`compression`. E.g. ``[[50, "int4"], [400, "int8"]]`` with ``compression: "none"``: under 50 Mbit/s
int4, under 400 int8, else fp32.

Why the slowest link: a ring moves at its slowest hop (every member forwards every chunk). Why a
table and not a formula (e.g. a byte budget per sync): the codec changes the loss as well as the bytes
(`docs/outer-optimizer.md`: int8/int4 within 1 % of fp32 at the same H, top-k only with lr 1, μ 0), so
which codec is acceptable is the researcher's call; the table says it once per job.

Every member of a ring must choose the same codec (they refuse each other's streams otherwise), so the
rates must be the same figures at every member: the agreed plan's (`LinkRates`, in bytes/s), never
each peer's own measurement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ravnest_p2p.averaging.pseudograd import DeltaCompression
from ravnest_p2p.averaging.session import LinkRates

__all__ = ["codec_for_rate", "ring_rate_mbps"]


def ring_rate_mbps(members: Sequence[str], link_rates: LinkRates | None) -> float | None:
    """The ring's slowest link in Mbit/s (rates in bytes/s), or None if a member's rates are unknown."""
    if link_rates is None or any(m not in link_rates for m in members):
        return None
    rate = min(min(link_rates[m]) for m in members)
    return 8 * rate / 1e6 if math.isfinite(rate) and rate > 0 else None


def codec_for_rate(
    table: Sequence[tuple[float, DeltaCompression]], rate_mbps: float | None, default: DeltaCompression
) -> DeltaCompression:
    """The codec of the first row whose rate `rate_mbps` is below; `default` if none (or no rate)."""
    if rate_mbps is not None:
        for below_mbps, codec in table:
            if rate_mbps < below_mbps:
                return codec
    return default
