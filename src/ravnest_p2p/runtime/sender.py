"""The sending half of a stage: owned background sends with retries, and what a failure means.

A send runs as a background task so the compute thread never waits on the network. Its outcome is one
of three, and each has one owner:

* delivered — the receiver queued it (``on_delivered``: the neighbour is alive);
* refused — the receiver answered with an error (`RemoteError`). Resending the same bytes cannot help,
  and a refusal is never fatal here: ``on_refused`` decides (drop the micro-batch, re-issue it, or
  nothing). A hostile or confused neighbour thus costs one micro-batch, not the stage;
* lost — ``send_attempts`` transport failures in a row (dial refused, stream reset, deadline): the
  neighbour is gone or unreachable, ``on_lost`` fails the stage with `NeighbourLost`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel
from torch import Tensor

from ravnest_p2p.errors import RemoteError, TransportError
from ravnest_p2p.runtime.pipeline import PipelineConfig, StageStats, tensor_bytes
from ravnest_p2p.transport.rpc import RpcEndpoint, RpcMethod
from ravnest_p2p.utils import TaskOwner

__all__ = ["Sender"]

logger = logging.getLogger(__name__)

RefusedHandler = Callable[[str, RpcMethod[Any, Any], BaseModel, RemoteError], None]


class Sender:
    """Sends of one stage service (see module docstring). Tasks are owned by ``tasks``."""

    def __init__(
        self,
        rpc: RpcEndpoint,
        config: PipelineConfig,
        stats: StageStats,
        tasks: TaskOwner,
        *,
        on_refused: RefusedHandler,
        on_lost: Callable[[str, str], None],
        on_delivered: Callable[[str], None],
    ) -> None:
        self.rpc = rpc
        self.config = config
        self.stats = stats
        self._tasks = tasks
        self._on_refused = on_refused
        self._on_lost = on_lost
        self._on_delivered = on_delivered

    def send(
        self, peer: str, method: RpcMethod[Any, Any], request: BaseModel, tensors: Sequence[Tensor]
    ) -> None:
        self._tasks.spawn(self._send(peer, method, request, tensors), name=f"send-{method.name}")

    async def _send(
        self, peer: str, method: RpcMethod[Any, Any], request: BaseModel, tensors: Sequence[Tensor]
    ) -> None:
        self.stats.send_started()
        try:
            await self._attempts(peer, method, request, tensors)
        finally:
            self.stats.send_ended()

    async def _attempts(
        self, peer: str, method: RpcMethod[Any, Any], request: BaseModel, tensors: Sequence[Tensor]
    ) -> None:
        for attempt in range(1, self.config.send_attempts + 1):
            try:
                await self.rpc.call(
                    peer,
                    method,
                    request,
                    tensors=tensors,
                    timeout_s=self.config.send_timeout_s,
                    compression=self.config.compression,
                )
                self.stats.bytes_sent += tensor_bytes(tensors)
                self._on_delivered(peer)
                return
            except RemoteError as exc:
                self._on_delivered(peer)  # it answered: alive, whatever it thinks of the message
                logger.info("%s refused by %s: %s", method.name, peer, exc)
                self._on_refused(peer, method, request, exc)
                return
            except TransportError as exc:
                logger.info("%s to %s failed (attempt %d): %s", method.name, peer, attempt, exc)
                if attempt < self.config.send_attempts:
                    await asyncio.sleep(0.2 * 2**attempt)  # a restarting daemon or a brief partition
        self._on_lost(peer, f"{method.name} failed {self.config.send_attempts} times")
