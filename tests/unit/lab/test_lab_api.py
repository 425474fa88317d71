"""Pure parts of the lab: public API, addressing scheme, name checks, throttle arithmetic."""

from __future__ import annotations

import pytest

import ravnest_p2p.lab as lab
from ravnest_p2p.lab.netns import NetnsLab, lab_address
from ravnest_p2p.lab.profiles import parse_profile
from ravnest_p2p.lab.throttle import ComputeThrottle, ThrottleBackend, base_cpus_to_fit, thread_env


def _profile(num_peers: int = 2) -> lab.SwarmProfile:
    return parse_profile({"run_id": "x", "peers": [{"name": f"p{i}"} for i in range(num_peers)]})


def test_public_api_is_pinned() -> None:
    assert sorted(lab.__all__) == [
        "ComputeThrottle",
        "NetnsLab",
        "PeerProfile",
        "ShapingMode",
        "SwarmProfile",
        "ThrottleBackend",
        "TransferResult",
        "WorkloadProfile",
        "base_cpus_to_fit",
        "detect_backend",
        "lab_address",
        "load_profile",
        "parse_profile",
        "receive_once",
        "remove_groups",
        "remove_leftovers",
        "send_bytes",
        "thread_env",
    ]


def test_lab_names_resolve_lazily() -> None:
    for name in lab.__all__:
        assert getattr(lab, name) is not None
    with pytest.raises(AttributeError):
        _ = lab.nope  # type: ignore[attr-defined]


def test_addresses_are_unique_and_in_benchmark_range() -> None:
    addresses = [lab_address(i) for i in range(1000)]
    assert len(set(addresses)) == 1000
    assert addresses[:2] == ["198.18.0.1", "198.18.0.2"]
    assert lab_address(250) == "198.18.1.1"
    for a in addresses:
        first, second, third, fourth = (int(x) for x in a.split("."))
        assert (first, second) == (198, 18)
        assert 0 <= third < 256
        assert 1 <= fourth <= 250
    with pytest.raises(ValueError):
        lab_address(-1)


@pytest.mark.parametrize("prefix", ["", "Rvt", "1abc", "rvt-1", "abcdefghi"])
def test_bad_prefix_rejected(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        NetnsLab(_profile(), prefix=prefix)


def test_names_fit_interface_limit() -> None:
    netlab = NetnsLab(_profile(3), prefix="abcdefgh")
    assert netlab.namespace_of("p2") == "abcdefgh-2"
    assert netlab.address_of(1) == "198.18.0.2"
    assert len(netlab.interface_of(2)) <= 15
    with pytest.raises(ValueError):
        netlab.address_of(3)


def test_throttle_for_follows_profile() -> None:
    profile = parse_profile(
        {"run_id": "x", "peers": [{"name": "a"}, {"name": "b", "compute_slowdown": 2.5, "memory_gb": 3}]}
    )
    netlab = NetnsLab(profile, prefix="rvtq")
    assert netlab.throttle_for("a", base_cpus=0.5).quota_us == 50_000
    throttle = netlab.throttle_for("b", base_cpus=2)
    assert (throttle.name, throttle.slowdown, throttle.base_cpus, throttle.memory_gb) == ("rvtq-1", 2.5, 2, 3)
    # a shorter CFS period: the same share of a shorter period
    short = netlab.throttle_for("b", base_cpus=0.6, period_us=20_000)
    assert (short.period_us, short.quota_us) == (20_000, 4_800)
    with pytest.raises(ValueError, match="period_us"):
        netlab.throttle_for("a", base_cpus=1, period_us=500)


def test_base_cpus_to_fit() -> None:
    hetero8 = [1.0] * 2 + [1.5] * 3 + [3.0] * 3
    assert base_cpus_to_fit(hetero8, num_cpus=2) == pytest.approx(0.4)
    assert base_cpus_to_fit([1.0], num_cpus=2) == 2
    with pytest.raises(ValueError):
        base_cpus_to_fit([], num_cpus=2)
    with pytest.raises(ValueError):
        base_cpus_to_fit([0.5], num_cpus=2)


def test_throttle_quota_and_thread_env() -> None:
    throttle = ComputeThrottle(name="t", slowdown=4.0, base_cpus=2.0, backend=ThrottleBackend.SIGSTOP)
    assert throttle.quota_us == 50_000
    assert throttle.wrap_argv(["a", "b"])[-2:] == ["a", "b"]
    assert throttle.wrap_argv(["a", "b"])[0] == "/bin/sh"  # starts stopped, released by the driver
    idle = ComputeThrottle(name="t", slowdown=1.0, backend=ThrottleBackend.SIGSTOP)
    assert idle.wrap_argv(["a", "b"]) == ["a", "b"]
    assert thread_env(3)["OMP_NUM_THREADS"] == "3"
    with pytest.raises(ValueError):
        ComputeThrottle(name="t", slowdown=0.5)
    with pytest.raises(ValueError):
        ComputeThrottle(name="bad name", slowdown=2.0)
    with pytest.raises(ValueError):
        thread_env(0)
