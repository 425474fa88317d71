"""A record's measured links: validated on read (ranges, ids, count), and the record stays under its cap."""

from __future__ import annotations

import math

import pytest
from hivemind.utils.serializer import MSGPackSerializer

from ravnest_p2p.discovery import DEFAULT_KEYS
from ravnest_p2p.discovery.records import MAX_LINKS, MAX_PLUGINS, SCHEMA_VERSION, parse_peer_record
from ravnest_p2p.errors import InvalidRecord

PEER = "QmVRjtfVd4D7oN4Ca6PPG8GoxuGoYwp47sEk9yYknEHqAj"
OTHER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def link(peer_id: str = OTHER, **overrides: object) -> dict[str, object]:
    value: dict[str, object] = {"peer_id": peer_id, "up_mbps": 50.0, "down_mbps": 80.0, "rtt_ms": 12.5}
    value.update(overrides)
    return value


def record(**overrides: object) -> dict[str, object]:
    value: dict[str, object] = {
        "schema_version": SCHEMA_VERSION,
        "peer_id": PEER,
        "flops": 1e11,
        "free_memory_bytes": 8 * 2**30,
        "state": "ready",
        "updated_at": 1.7e9,
        "links": [link()],
    }
    value.update(overrides)
    return value


def test_links_parse_and_default_to_none() -> None:
    parsed = parse_peer_record(record(), signer_peer_id=PEER)
    assert parsed.links[0].peer_id == OTHER
    assert parsed.links[0].down_mbps == 80.0
    assert parse_peer_record(record(links=[]), signer_peer_id=PEER).links == ()
    without = record()
    del without["links"]
    assert parse_peer_record(without, signer_peer_id=PEER).links == ()


@pytest.mark.parametrize(
    "links",
    [
        [link(up_mbps=math.nan)],
        [link(down_mbps=math.inf)],
        [link(up_mbps=0.0)],
        [link(down_mbps=1e9)],
        [link(rtt_ms=-1.0)],
        [link(rtt_ms=1e9)],
        [link(peer_id="not base58 0OIl!")],
        [link(peer_id=PEER)],  # a link to itself
        [link(), link()],  # the same peer twice
        [link(up_mbps="fast")],
        ["not a map"],
        [link(peer_id=f"Qm{i:044d}".replace("0", "z")) for i in range(MAX_LINKS + 1)],
    ],
)
def test_hostile_links_refuse_the_record(links: list[object]) -> None:
    with pytest.raises(InvalidRecord):
        parse_peer_record(record(links=links), signer_peer_id=PEER)


def test_largest_valid_record_fits_the_peers_key() -> None:
    cap = next(spec.max_value_bytes for spec in DEFAULT_KEYS if spec.name == "peers")
    long_id = "Q" + "m" * 127
    links = [
        link(peer_id=long_id[: 128 - 3] + f"{i:03d}".replace("0", "a"), up_mbps=123456.789, rtt_ms=59999.9)
        for i in range(MAX_LINKS)
    ]
    value = record(
        links=links,
        maddrs=["/" + "x" * 511] * 16,
        software_version="v" * 64,
        device="d" * 64,
        rtt_ms=1.5,
        run_owner=long_id,
        upload_mbps=399999.9,
        download_mbps=399999.9,
        cluster=100_000,
        stage=100_000,
        epoch=2**62,
        client_mode=False,
        plugin_models=[f"m{i:02d}" + "x" * 45 for i in range(MAX_PLUGINS)],
        plugin_datasets=[f"d{i:02d}" + "x" * 45 for i in range(MAX_PLUGINS)],
        unfit_job="j" * 64,
        unfit_reason="r" * 200,
    )
    parsed = parse_peer_record(value, signer_peer_id=PEER)
    assert len(parsed.plugin_models) == MAX_PLUGINS
    size = len(MSGPackSerializer.dumps(parsed.model_dump(mode="json")))
    assert size < cap, size  # 16051 of 16384 bytes with maximal plugin fields
