"""A tiny raw-TCP throughput probe for checking the lab's link shaping.

One TCP connection, bounded in bytes and in time, no framing. The receiver's figure is the one to trust:
it counts from the first to the last byte that actually arrived, whereas the sender's clock stops when
the last bytes enter its socket buffer. Run as::

    python -m ravnest_p2p.lab.rawtransfer serve --host 198.18.0.1 --port 0 --timeout-s 10
    python -m ravnest_p2p.lab.rawtransfer send --host 198.18.0.1 --port 40123 --bytes 7500000

``serve`` prints one JSON line ``{"listening": <port>}`` as soon as it accepts connections, then one JSON
line with the result; ``send`` prints its own result line. Results carry ``num_bytes``, ``seconds`` and
``mbps`` (10**6 bit/s).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

from pydantic import BaseModel, ConfigDict

__all__ = ["TransferResult", "receive_once", "send_bytes"]

_CHUNK_BYTES = 64 * 1024


class TransferResult(BaseModel):
    """What one side of a transfer measured."""

    model_config = ConfigDict(frozen=True)

    num_bytes: int
    seconds: float
    mbps: float


def _result(num_bytes: int, seconds: float) -> TransferResult:
    mbps = num_bytes * 8 / seconds / 1e6 if seconds > 0 else 0.0
    return TransferResult(num_bytes=num_bytes, seconds=seconds, mbps=mbps)


def receive_once(listener: socket.socket, *, max_bytes: int, timeout_s: float) -> TransferResult:
    """Accept one connection on ``listener`` and count what arrives.

    Stops at EOF, after ``max_bytes``, or when ``timeout_s`` (from the call) has passed.

    Args:
        listener: a bound, listening socket.
        max_bytes: stop reading after this many bytes.
        timeout_s: overall deadline for accept plus transfer.

    Raises:
        TimeoutError: nobody connected before the deadline.
    """
    deadline = time.monotonic() + timeout_s
    listener.settimeout(timeout_s)
    conn, _ = listener.accept()
    with conn:
        received = uncounted = 0
        first = last = 0.0
        while received < max_bytes:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                break
            conn.settimeout(remaining_s)
            try:
                chunk = conn.recv(min(_CHUNK_BYTES * 4, max_bytes - received))
            except TimeoutError:
                break
            if not chunk:
                break
            last = time.monotonic()
            if received == 0:
                # The first recv's bytes arrived before `first`: count the rate from here on only.
                first = last
                uncounted = len(chunk)
            received += len(chunk)
    return _result(received - uncounted, last - first)


def send_bytes(host: str, port: int, *, num_bytes: int, timeout_s: float) -> TransferResult:
    """Connect (retrying until the deadline) and send ``num_bytes`` zero bytes, or less on timeout.

    Raises:
        TimeoutError: could not connect before the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"could not connect to {host}:{port} within {timeout_s} s") from None
            time.sleep(0.05)  # retry interval while the server starts, bounded by the deadline
    payload = bytes(_CHUNK_BYTES)
    sent = 0
    with sock:
        start = time.monotonic()
        while sent < num_bytes:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                break
            sock.settimeout(remaining_s)
            try:
                sent += sock.send(payload[: min(_CHUNK_BYTES, num_bytes - sent)])
            except TimeoutError:
                break
        sock.shutdown(socket.SHUT_WR)
        return _result(sent, time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``serve`` or ``send``."""
    parser = argparse.ArgumentParser(prog="python -m ravnest_p2p.lab.rawtransfer", description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    serve = sub.add_parser("serve", help="accept one connection and report the received rate")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0)
    serve.add_argument("--max-bytes", type=int, default=1 << 30)
    serve.add_argument("--timeout-s", type=float, default=30.0)
    send = sub.add_parser("send", help="send bytes and report the sent rate")
    send.add_argument("--host", required=True)
    send.add_argument("--port", type=int, required=True)
    send.add_argument("--bytes", type=int, required=True, dest="num_bytes")
    send.add_argument("--timeout-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    try:
        if args.mode == "serve":
            with socket.create_server((args.host, args.port)) as listener:
                print(json.dumps({"listening": listener.getsockname()[1]}), flush=True)
                result = receive_once(listener, max_bytes=args.max_bytes, timeout_s=args.timeout_s)
        else:
            result = send_bytes(args.host, args.port, num_bytes=args.num_bytes, timeout_s=args.timeout_s)
    except (TimeoutError, OSError) as e:
        print(f"rawtransfer {args.mode}: {e or type(e).__name__}", file=sys.stderr)
        return 1
    print(result.model_dump_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
