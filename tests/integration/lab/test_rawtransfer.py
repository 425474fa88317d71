"""The raw TCP probe on loopback: bounded in bytes and time, both sides agree on the byte count."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

from ravnest_p2p.lab.rawtransfer import TransferResult, receive_once, send_bytes


def test_loopback_transfer_counts_bytes() -> None:
    num_bytes = 4_000_000
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        results: list[TransferResult] = []
        receiver = threading.Thread(
            target=lambda: results.append(receive_once(listener, max_bytes=num_bytes, timeout_s=10))
        )
        receiver.start()
        sent = send_bytes("127.0.0.1", port, num_bytes=num_bytes, timeout_s=10)
        receiver.join(timeout=10)
    assert sent.num_bytes == num_bytes
    (received,) = results
    # The receiver does not count its first read (it starts the clock), so slightly fewer bytes.
    assert 0 < num_bytes - received.num_bytes <= 256 * 1024
    assert received.mbps > 0


def test_cli_round_trip_and_timeouts() -> None:
    tool = [sys.executable, "-m", "ravnest_p2p.lab.rawtransfer"]
    server = subprocess.Popen(
        [*tool, "serve", "--timeout-s", "10", "--max-bytes", "1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert server.stdout is not None
    port = json.loads(server.stdout.readline())["listening"]
    sender = subprocess.run(
        [*tool, "send", "--host", "127.0.0.1", "--port", str(port), "--bytes", "1000000"],
        capture_output=True,
        check=True,
        timeout=20,
    )
    out, err = server.communicate(timeout=20)
    assert json.loads(sender.stdout)["num_bytes"] == 1_000_000
    assert json.loads(out)["num_bytes"] > 0
    assert b"Warning" not in err  # no runpy double-import warning
    lonely = subprocess.run([*tool, "serve", "--timeout-s", "0.2"], capture_output=True, timeout=20)
    assert lonely.returncode == 1
    assert b"rawtransfer serve" in lonely.stderr
