"""The status tool's owner line: who owns a run, as its peers enforce it."""

from ravnest_p2p.discovery import PeerRecord
from ravnest_p2p.status import format_owner, no_peers_hint

OWNER, OTHER = "QmW" + "w" * 20, "QmX" + "x" * 20


def rec(i: int, owner: str | None, *, client: bool = False) -> PeerRecord:
    return PeerRecord(
        peer_id=f"QmP{i}" + "p" * 20,
        flops=1,
        free_memory_bytes=1,
        run_owner=owner,
        client_mode=client,
        updated_at=1,
    )


def test_an_owned_run_names_its_owner():
    assert format_owner([rec(1, OWNER), rec(2, OWNER)]) == f"owner: {OWNER} (2/2 peers enforce it)"


def test_an_open_run_says_so_plainly():
    assert format_owner([rec(1, None)]).startswith("open run: no owner; 1/1 peers train anyone's job")


def test_disagreeing_peers_are_flagged():
    line = format_owner([rec(1, OWNER), rec(2, OWNER), rec(3, None), rec(4, OTHER, client=True)], OWNER)
    assert line.startswith(f"owner: {OWNER} (2/3 peers")
    assert "WARNING other peers: 1 open" in line
    assert "1/3 peers do not enforce owner" in line
    assert "WARNING" in format_owner([rec(1, None)], OWNER)


def test_no_peers_hints_at_the_run_id() -> None:
    assert "--run-id" in no_peers_hint("default", run_id_given=False)
    assert "run 'x'" in no_peers_hint("x", run_id_given=True)
    assert "reachable" in no_peers_hint("x", run_id_given=True)
