"""The dashboard's snapshot (`/api/state`) built from fakes, its HTTP routing, bind rules and escaping."""

from __future__ import annotations

import asyncio
import json
import re
from importlib import resources

import pytest

from ravnest_p2p.dashboard import DashboardServer, check_bind, parse_bind
from ravnest_p2p.dashboard.server import MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES
from ravnest_p2p.dashboard.state import MAX_PEERS, MAX_POINTS, History, build_state
from ravnest_p2p.status import main as status_main
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.progress import ProgressView
from tests.unit.dashboard._fakes import peer, pid, stage

HOSTILE = "<img src=x onerror=alert(1)>"


def snapshot(history: History | None = None, *, device: str = "cpu") -> dict:
    records = [peer(i, cluster=i // 2, stage=i % 2, device=device) for i in range(4)] + [peer(9)]
    metrics = [
        stage(c, s, step=100 + c, loss=0.5 if s == 1 else None, rounds=7 + s) for c in (0, 1) for s in (0, 1)
    ]
    return build_state(
        run_id="r",
        now=1000.0,
        records=records,
        epoch=3,
        digests={"a": "d" * 64, "b": "d" * 64, "c": "e" * 64},
        job=JobSpec(job_id="j1", max_steps=500),
        progress=ProgressView(job_id="j1", epoch=3, micro_batches=201, train_wall_s=12.345),
        metrics=metrics,
        history=history,
    )


def test_snapshot_has_peers_plan_job_stages_and_averaging():
    state = snapshot()
    assert state["num_peers"] == 5
    first = state["peers"][0]
    assert first["gflops"] == 2.5
    assert first["mem_gb"] == 3.0
    assert (first["up_mbps"], first["down_mbps"], first["rtt_ms"]) == (100.0, 200.0, 1.2)
    assert first["age_s"] == 10.0
    assert state["plan"]["epoch"] == 3
    assert state["plan"]["agree"] == 2
    assert state["plan"]["published"] == 3
    assert [len(c["stages"]) for c in state["plan"]["clusters"]] == [2, 2]  # the unplaced peer is left out
    job = state["job"]
    assert job["job_id"] == "j1"
    assert job["micro_batches"] == 201
    assert [c["step"] for c in job["clusters"]] == [100, 101]
    assert job["clusters"][0]["loss"] == 0.5
    assert job["clusters"][0]["eval_accuracy"] == 0.9
    assert len(state["stages"]) == 4
    assert state["averaging"] == {
        "min_rounds": 7,
        "max_rounds": 8,
        "slowest_round_s": 1.4,
        "min_participants": 2,
        "mb_sent": 20.0,
    }
    json.dumps(state, allow_nan=False)  # JSON as it will be served


def test_no_job_is_an_empty_job_section():
    state = build_state(
        run_id="r", now=1.0, records=[], epoch=0, digests={}, job=None, progress=None, metrics=[]
    )
    assert state["job"] is None
    assert state["plan"]["digest"] is None
    assert state["history"] == {}


def test_history_keeps_changes_only_is_bounded_and_restarts_with_a_new_job():
    history = History()
    metrics = [stage(0, 0, step=1, loss=None, rounds=0), stage(0, 1, step=1, loss=2.0, rounds=0)]
    history.add("j1", metrics, now=history.started_at + 1)
    history.add("j1", metrics, now=history.started_at + 2)  # nothing changed: no new point
    assert len(history.as_json()["0"]) == 1
    for i in range(MAX_POINTS + 50):
        history.add("j1", [stage(0, 0, step=i + 2, loss=1.0, rounds=0)], now=history.started_at + i)
    assert len(history.as_json()["0"]) == MAX_POINTS
    history.add("j2", metrics)
    assert len(history.as_json()["0"]) == 1
    assert snapshot(history)["history"]["0"][0]["loss"] == 2.0


def test_peers_are_capped():
    records = [peer(i) for i in range(MAX_PEERS + 20)]
    state = build_state(
        run_id="r", now=1.0, records=records, epoch=0, digests={}, job=None, progress=None, metrics=[]
    )
    assert state["num_peers"] == MAX_PEERS + 20
    assert len(state["peers"]) == MAX_PEERS


def test_strings_from_the_dht_stay_data_in_the_json():
    state = snapshot(device=HOSTILE)
    assert state["peers"][0]["device"] == HOSTILE  # passed as data; the page renders it as text


def test_the_page_never_parses_dht_strings_as_markup():
    """The escaping rule: the page's script sets text with textContent only (no HTML sinks), and the
    page loads no script but its own (no CDN, no inline handler)."""
    static = resources.files("ravnest_p2p.dashboard").joinpath("static")
    script = static.joinpath("app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "Function("):
        assert sink not in script, sink
    assert "textContent" in script
    page = static.joinpath("index.html").read_text()
    assert re.findall(r"<script[^>]*>", page) == ['<script src="/app.js">']
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page + script
    assert not re.search(r"\son[a-z]+=", page)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:8080", ("127.0.0.1", 8080)), ("[::1]:0", ("::1", 0)), ("localhost:80", ("localhost", 80))],
)
def test_parse_bind(text, expected):
    assert parse_bind(text) == expected


@pytest.mark.parametrize("text", ["8080", "127.0.0.1", "host:port", ":80", "127.0.0.1:70000"])
def test_parse_bind_rejects(text):
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_bind(text)


def test_non_loopback_binds_need_the_public_flag():
    check_bind("127.0.0.1", public=False)
    check_bind("::1", public=False)
    check_bind("localhost", public=False)
    for host in ("0.0.0.0", "198.18.0.1", "example.org"):
        with pytest.raises(ValueError, match="--serve-public"):
            check_bind(host, public=False)
        check_bind(host, public=True)


def test_status_cli_refuses_a_public_bind_without_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        status_main(["--initial-peers", "/ip4/127.0.0.1/tcp/1", "--serve", "0.0.0.0:8080"])
    assert exc.value.code == 2
    assert "--serve-public" in capsys.readouterr().err


def test_routes_and_host_check():
    server = DashboardServer(lambda: {"ok": 1}, "127.0.0.1", 0)
    local = {"host": "127.0.0.1:8080"}
    assert server.respond("GET", "/", local)[0] == 200
    assert server.respond("GET", "/app.js", local)[2].startswith("text/javascript")
    assert server.respond("GET", "/api/state?x=1", local)[1] == b'{"ok":1}'
    assert server.respond("GET", "/nope", local)[0] == 404
    assert server.respond("POST", "/api/state", local)[0] == 405
    assert server.respond("GET", "/", {"host": "localhost:8080"})[0] == 200
    assert server.respond("GET", "/", {"host": "[::1]:8080"})[0] == 200
    assert server.respond("GET", "/", {"host": "evil.example:8080"})[0] == 421  # DNS rebinding
    public = DashboardServer(lambda: {}, "0.0.0.0", 0)
    assert public.respond("GET", "/", {"host": "dash.example:8080"})[0] == 200


def test_an_oversized_snapshot_is_replaced_by_an_error():
    server = DashboardServer(lambda: {"blob": "x" * (MAX_RESPONSE_BYTES + 1)}, "127.0.0.1", 0)
    status, body, _ = server.respond("GET", "/api/state", {"host": "127.0.0.1"})
    assert status == 200
    assert len(body) < 200
    assert "error" in json.loads(body)


async def _http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    await writer.wait_closed()
    return data


async def test_serves_over_a_real_socket_with_security_headers_and_bounded_requests():
    async with DashboardServer(lambda: {"peers": [{"device": HOSTILE}]}, "127.0.0.1", 0) as server:
        assert server.url == f"http://127.0.0.1:{server.port}/"
        raw = await _http(server.port, b"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        assert b"Content-Security-Policy: default-src 'none'; script-src 'self'" in head
        assert b"X-Content-Type-Options: nosniff" in head
        assert json.loads(body) == {"peers": [{"device": HOSTILE}]}
        raw = await _http(server.port, b"HEAD / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 200")
        assert raw.endswith(b"\r\n\r\n")
        # a request head past the limit gets no answer, just a closed connection
        huge = b"GET / HTTP/1.1\r\nX: " + b"a" * (MAX_REQUEST_BYTES * 2) + b"\r\n\r\n"
        assert await _http(server.port, huge) == b""
        assert (await _http(server.port, b"garbage\r\n\r\n")).startswith(b"HTTP/1.1 400")


def test_peers_show_their_plugins_and_why_they_are_unfit_for_the_active_job():
    plain = peer(1)
    serves = peer(2).model_copy(update={"plugin_models": ("toy_net",), "plugin_datasets": ("toy_data",)})
    refused = serves.model_copy(update={"peer_id": pid(3), "unfit_job": "j2", "unfit_reason": HOSTILE})
    other_job = serves.model_copy(update={"peer_id": pid(4), "unfit_job": "old", "unfit_reason": "x"})
    job = JobSpec(job_id="j2", model="toy_net", dataset="toy_data")  # plugins: not installed here
    state = build_state(
        run_id="r",
        now=1000.0,
        records=[plain, serves, refused, other_job],
        epoch=3,
        digests={},
        job=job,
        progress=None,
        metrics=[],
    )
    rows = {row["peer_id"]: row for row in state["peers"]}
    assert rows[plain.peer_id]["unfit"] == "lacks plugin model toy_net, plugin data set toy_data"
    assert rows[plain.peer_id]["plugin_models"] == []
    assert rows[serves.peer_id]["unfit"] == ""  # fit
    assert rows[serves.peer_id]["plugin_models"] == ["toy_net"]
    assert rows[serves.peer_id]["plugin_datasets"] == ["toy_data"]
    assert rows[refused.peer_id]["unfit"] == HOSTILE  # its own word, passed as data
    assert rows[other_job.peer_id]["unfit"] == ""  # unfit for another job only
    assert rows[other_job.peer_id]["unfit_job"] == "old"
    assert state["job"]["mode"] == "pipeline"
    # a built-in job needs no plugin: every peer is fit; no job: no verdict
    assert {row["unfit"] for row in snapshot()["peers"]} == {""}
    no_job = build_state(
        run_id="r", now=1.0, records=[plain], epoch=0, digests={}, job=None, progress=None, metrics=[]
    )
    assert no_job["peers"][0]["unfit"] is None
