"""Typed RPC on top of the byte transport: pydantic messages plus tensors, deadlines, error replies.

A method is declared once (`RpcMethod`) with its request and response models and its size limits; the
server side validates every request against them before the handler sees it, and any failure becomes an
error reply (`RemoteError` at the caller) instead of a crash. Handler names are namespaced by run id so
two runs can share a daemon without crossing wires.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from pydantic import BaseModel, ValidationError

from ravnest_p2p.errors import DeadlineExceeded, InvalidMessage, RemoteError, TransportError
from ravnest_p2p.transport.base import Transport
from ravnest_p2p.transport.codec import Compression, decode_tensor, encode_tensor_parts
from ravnest_p2p.transport.wire import Buffer, decode_envelope, encode_envelope_parts, error_envelope

__all__ = ["CallContext", "Reply", "RpcEndpoint", "RpcMethod"]

logger = logging.getLogger(__name__)

ReqT = TypeVar("ReqT", bound=BaseModel)
RespT = TypeVar("RespT", bound=BaseModel)


@dataclass(frozen=True)
class RpcMethod(Generic[ReqT, RespT]):
    """One remote procedure: its name, message types and limits."""

    name: str
    request_type: type[ReqT]
    response_type: type[RespT]
    max_request_bytes: int = 1 << 20
    max_response_bytes: int = 1 << 20
    max_tensors: int = 64
    large_response: bool = False  # replies may exceed the unary cap: always use a stream
    handler_timeout_s: float = 60.0


@dataclass(frozen=True)
class CallContext:
    remote_peer_id: str
    method: str


@dataclass(frozen=True)
class Reply(Generic[RespT]):
    message: RespT
    tensors: list[torch.Tensor] = field(default_factory=list)


HandlerResult = BaseModel | tuple[BaseModel, Sequence[torch.Tensor]]
Handler = Callable[[Any, list[torch.Tensor], CallContext], Awaitable[HandlerResult]]


def _encode_parts(
    kind: str, message: BaseModel, tensors: Sequence[torch.Tensor], compression: Compression
) -> list[Buffer]:
    blobs = [encode_tensor_parts(t, compression) for t in tensors]
    return encode_envelope_parts({"kind": kind, "body": message.model_dump(mode="json")}, blobs)


def _encode(
    kind: str, message: BaseModel, tensors: Sequence[torch.Tensor], compression: Compression
) -> bytes:
    return b"".join(_encode_parts(kind, message, tensors, compression))


def _decode_body(model: type[RespT], body: Any) -> RespT:
    if not isinstance(body, dict):
        raise InvalidMessage("message body is not a map")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise InvalidMessage(
            f"{model.__name__} does not validate: {exc.error_count()} errors: {exc}"
        ) from None


class RpcEndpoint:
    """Serve and call typed methods over one transport, under a namespace (usually the run id)."""

    def __init__(self, transport: Transport, namespace: str, *, compression: Compression = Compression.NONE):
        self.transport = transport
        self.namespace = namespace
        self.compression = compression
        self.served: dict[str, RpcMethod[Any, Any]] = {}
        """The methods this endpoint serves, by name (what a peer exposes to anyone who dials it)."""
        self.bytes_sent: collections.Counter[str] = collections.Counter()
        """Encoded bytes handed to the transport, by method name (requests made + replies served)."""
        self.bytes_received: collections.Counter[str] = collections.Counter()
        """Encoded bytes taken from the transport, by method name (replies got + requests served)."""

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    def _qualified(self, method: RpcMethod[Any, Any]) -> str:
        return f"ravnest/{self.namespace}/{method.name}"

    async def serve(self, method: RpcMethod[ReqT, RespT], handler: Handler) -> None:
        async def raw(data: Buffer, remote_peer_id: str) -> bytes:
            self.bytes_received[method.name] += memoryview(data).nbytes
            reply = await self._answer(method, handler, data, remote_peer_id)
            self.bytes_sent[method.name] += len(reply)
            return reply

        await self.transport.add_handler(
            self._qualified(method), raw, max_request_bytes=method.max_request_bytes
        )
        self.served[method.name] = method

    async def _answer(
        self, method: RpcMethod[Any, Any], handler: Handler, data: Buffer, remote_peer_id: str
    ) -> bytes:
        context = CallContext(remote_peer_id=remote_peer_id, method=method.name)
        try:
            envelope = decode_envelope(data, max_bytes=method.max_request_bytes)
            if envelope.header.get("kind") != "request":
                raise InvalidMessage("expected a request")
            if len(envelope.blobs) > method.max_tensors:
                raise InvalidMessage(
                    f"{len(envelope.blobs)} tensors exceed the limit of {method.max_tensors}"
                )
            request = _decode_body(method.request_type, envelope.header.get("body"))
            tensors = [decode_tensor(blob) for blob in envelope.blobs]
            result = await asyncio.wait_for(handler(request, tensors, context), method.handler_timeout_s)
            message, out_tensors = result if isinstance(result, tuple) else (result, ())
            return _encode("response", message, out_tensors, self.compression)
        except InvalidMessage as exc:
            logger.debug("refused %s from %s: %s", method.name, remote_peer_id, exc)
            return error_envelope(exc.code, str(exc))
        except TimeoutError:
            return error_envelope("handler_timeout", f"{method.name} took over {method.handler_timeout_s}s")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a peer boundary: log it with the caller, reply, keep serving
            logger.warning("handler %s failed for %s: %r", method.name, remote_peer_id, exc, exc_info=True)
            return error_envelope("internal", f"{type(exc).__name__}: {exc}")

    async def unserve(self, method: RpcMethod[Any, Any]) -> None:
        self.served.pop(method.name, None)
        await self.transport.remove_handler(self._qualified(method))

    async def call(
        self,
        peer_id: str,
        method: RpcMethod[ReqT, RespT],
        request: ReqT,
        *,
        tensors: Sequence[torch.Tensor] = (),
        timeout_s: float,
        compression: Compression | None = None,
        foreground: bool | None = None,
    ) -> Reply[RespT]:
        """Call `method` on `peer_id`; raise `RemoteError`, `DeadlineExceeded` or `PeerUnreachable`.

        `foreground` (default: whether the call carries tensors) marks the call in progress on the
        transport's `TrafficGate`, so background averaging parts yield to it.
        """
        # pieces: a big tensor goes from its own memory to the stream, without an intermediate copy
        data = _encode_parts(
            "request", request, tensors, self.compression if compression is None else compression
        )
        self.bytes_sent[method.name] += sum(memoryview(part).nbytes for part in data)
        gate = self.transport.gate
        mark = gate.foreground() if (bool(tensors) if foreground is None else foreground) else nullcontext()
        try:
            with mark:
                raw = await asyncio.wait_for(
                    self.transport.call(
                        peer_id,
                        self._qualified(method),
                        data,
                        stream=method.large_response,
                        max_response_bytes=method.max_response_bytes,
                    ),
                    timeout_s,
                )
        except TimeoutError:
            raise DeadlineExceeded(f"{method.name} to {peer_id} exceeded {timeout_s:.1f}s") from None
        except InvalidMessage as exc:  # e.g. an oversized reply
            raise TransportError(f"{method.name} reply from {peer_id} refused: {exc}") from None
        self.bytes_received[method.name] += memoryview(raw).nbytes
        try:
            envelope = decode_envelope(raw, max_bytes=method.max_response_bytes)
            kind = envelope.header.get("kind")
            if kind == "error":
                raise RemoteError(str(envelope.header.get("code")), str(envelope.header.get("message")))
            if kind != "response":
                raise InvalidMessage(f"unexpected reply kind {kind!r}")
            message = _decode_body(method.response_type, envelope.header.get("body"))
            out = [decode_tensor(blob) for blob in envelope.blobs]
        except InvalidMessage as exc:
            raise TransportError(f"malformed {method.name} reply from {peer_id}: {exc}") from None
        return Reply(message=message, tensors=out)
