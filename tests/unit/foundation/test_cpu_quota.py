"""The compute cache key's CPU limit: read from the cgroup files, or named by the group when hidden."""

from __future__ import annotations

from pathlib import Path

from ravnest_p2p.measurement.compute import cpu_quota

V1_IN_GROUP = "4:memory:/x/lab-0\n1:cpu:/lab-0\n2:cpuacct:/\n0::/\n"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_v1_quota_is_read_from_the_cpu_hierarchy(tmp_path: Path) -> None:
    proc = _write(tmp_path / "proc", V1_IN_GROUP)
    _write(tmp_path / "cg" / "cpu" / "lab-0" / "cpu.cfs_quota_us", "13333\n")
    assert cpu_quota(proc, tmp_path / "cg") == "13333"


def test_v2_quota_and_no_quota(tmp_path: Path) -> None:
    proc = _write(tmp_path / "proc", "0::/box\n")
    _write(tmp_path / "cg" / "box" / "cpu.max", "50000 100000\n")
    assert cpu_quota(proc, tmp_path / "cg") == "50000 100000"
    _write(tmp_path / "cg" / "box" / "cpu.max", "max 100000\n")
    assert cpu_quota(proc, tmp_path / "cg") == "max"


def test_a_hidden_cgroup_fs_names_the_group_so_capped_peers_never_share_a_figure(
    tmp_path: Path,
) -> None:
    # `ip netns exec` mounts a fresh /sys: the group is listed but its files are not there
    proc = _write(tmp_path / "proc", V1_IN_GROUP)
    assert cpu_quota(proc, tmp_path / "empty") == "unknown in cpu:/lab-0"
    other = _write(tmp_path / "proc2", V1_IN_GROUP.replace("lab-0", "lab-1"))
    assert cpu_quota(other, tmp_path / "empty") != cpu_quota(proc, tmp_path / "empty")
    # in the root group with nothing readable there is no limit to name
    root = _write(tmp_path / "proc3", "1:cpu:/\n0::/\n")
    assert cpu_quota(root, tmp_path / "empty") == "max"
