"""A small read-only HTTP server for the dashboard, on asyncio streams (no web framework).

It serves three things: the page (``/``), its script (``/app.js``) and the run's snapshot
(``/api/state``, JSON). It is meant for a volunteer's or researcher's own machine, so:

- it binds only the address it is given, and `check_bind` refuses a non-loopback address unless the
  operator asked for a public dashboard explicitly;
- it answers GET and HEAD only, reads at most `MAX_REQUEST_BYTES` of request head, and caps every
  response at `MAX_RESPONSE_BYTES` (a snapshot past it is replaced by an error);
- on a loopback bind it answers only requests whose ``Host`` is a loopback name (a web page elsewhere
  cannot read the run through DNS rebinding);
- a strict Content-Security-Policy allows only this server's own script: even a string that escaped
  the page's ``textContent`` rule could not run.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import Callable
from importlib import resources
from typing import Any

__all__ = ["MAX_REQUEST_BYTES", "MAX_RESPONSE_BYTES", "DashboardServer", "check_bind", "parse_bind"]

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192
MAX_RESPONSE_BYTES = 4 * 2**20
_REQUEST_TIMEOUT_S = 10.0
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
_CSP = (
    "default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'unsafe-inline'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def parse_bind(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port); raises `ValueError`."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"--serve takes HOST:PORT, e.g. 127.0.0.1:8080 (got {text!r})")
    return host.removeprefix("[").removesuffix("]"), int(port_text)


def is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, *, public: bool) -> None:
    """Refuse a non-loopback bind unless `public` (the dashboard then shows the run to the network)."""
    if not public and not is_loopback(host):
        raise ValueError(
            f"refusing to serve the dashboard on non-loopback address {host}: "
            "pass --serve-public to show the run to your network"
        )


def _static(name: str) -> bytes:
    return resources.files("ravnest_p2p.dashboard").joinpath("static", name).read_bytes()


class DashboardServer:
    """Serves the page and `snapshot()` on (host, port); use as ``async with``; `port` is the bound port."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], host: str, port: int) -> None:
        self._snapshot = snapshot
        self.host = host
        self.port = port
        self._check_host = is_loopback(host)
        self._server: asyncio.Server | None = None
        self._files = {
            "/": (_static("index.html"), "text/html; charset=utf-8"),
            "/app.js": (_static("app.js"), "text/javascript; charset=utf-8"),
        }

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=MAX_REQUEST_BYTES, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> DashboardServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _host_allowed(self, headers: dict[str, str]) -> bool:
        if not self._check_host:
            return True
        host = headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return name.lower() in _LOOPBACK_NAMES or is_loopback(name.strip("[]"))

    def respond(self, method: str, target: str, headers: dict[str, str]) -> tuple[int, bytes, str]:
        """(status, body, content type) of one request: the routing, apart from the socket."""
        if method not in ("GET", "HEAD"):
            return 405, b"method not allowed\n", "text/plain; charset=utf-8"
        if not self._host_allowed(headers):
            return 421, b"unexpected Host header\n", "text/plain; charset=utf-8"
        path = target.split("?", 1)[0]
        if path in self._files:
            body, kind = self._files[path]
            return 200, body, kind
        if path == "/api/state":
            body = json.dumps(self._snapshot(), allow_nan=False, separators=(",", ":")).encode()
            if len(body) > MAX_RESPONSE_BYTES:
                body = json.dumps({"error": f"snapshot over {MAX_RESPONSE_BYTES} bytes"}).encode()
            return 200, body, "application/json"
        return 404, b"not found\n", "text/plain; charset=utf-8"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3:
                status, body, kind, method = 400, b"bad request\n", "text/plain; charset=utf-8", "GET"
            else:
                method, target, _ = parts
                headers = {}
                for line in lines[1:]:
                    name, sep, value = line.partition(":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                status, body, kind = self.respond(method, target, headers)
            reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
            response = [
                f"HTTP/1.1 {status} {reason.get(status, 'Error')}",
                f"Content-Type: {kind}",
                f"Content-Length: {len(body)}",
                "Cache-Control: no-store",
                "X-Content-Type-Options: nosniff",
                "Referrer-Policy: no-referrer",
                f"Content-Security-Policy: {_CSP}",
                "Connection: close",
            ]
            writer.write(("\r\n".join(response) + "\r\n\r\n").encode())
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a slow, oversized or vanished client: just hang up
        except ValueError:  # readuntil past the limit
            pass
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass
