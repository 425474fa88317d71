"""Push-pull anti-entropy of membership views over typed RPC (`gossip_view`).

Each period a peer contacts a small random fanout. One contact is at most two calls:

1. *pull*: we send our epoch, view digest and per-bucket digests (``16 x num_buckets`` bytes). Equal
   digests: the reply is a few bytes and we are done. Otherwise the peer answers with which buckets
   differ and its summary items (peer id, version, content digest) in those buckets only.
2. *push*: we send back our items the peer lacks or holds older, for the same buckets.

What is trusted. Gossip carries *summaries*, never records: a summary is a claim by the sender (whose
peer id libp2p authenticates) about somebody else, so it is only news. The receiver decides what to do
with news through ``on_news``: the service treats it as a hint to re-read the signed records from the
DHT at once (and adopts only what validates there, exactly as the directory does); the simulator and
tests may merge it directly, standing in for a signed-record fetch. We rejected carrying the raw signed
DHT values: re-verifying them needs hivemind's validator outside the discovery adapter and they cost
~0.5 KB per entry, while the DHT already serves each record to whoever asks.

Epoch numbers ride along, but a heard epoch is only a claim by its sender: ``on_epoch(sender, epoch)``
hands it to the owner, which adopts it only when members' signed records back it (see `epochs`).
Every call has a deadline; a malformed request (bad field, wrong bucket count, items outside the
buckets they claim) gets an error reply and changes nothing. Gossip about a peer we cannot reach is
logged at DEBUG and forgotten until the next round.

Suspect reports ride along as a version number (``suspects_version``, the time the sender last
published its signed `SuspectReport`): a receiver reads the ``suspects`` key only when a member
shows a version it has not read, so steady state costs no DHT search (`membership.suspects`).

Rate limits (`transport.ledger.RateLimiter`, optional, `GossipLimits`): every sender has a token
bucket; a sender that is not a member (``is_member`` false: no valid signed record in our directory)
gets a small one, and all such strangers together share one more, so a flood of fresh identities
costs a bounded amount of work. An empty bucket is refused (`RateLimited`) before the request's content
is processed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from ravnest_p2p.errors import InvalidMessage, RateLimited, TransportError
from ravnest_p2p.membership.view import MembershipView, SummaryItem, bucket_of
from ravnest_p2p.transport import CallContext, RpcEndpoint, RpcMethod
from ravnest_p2p.transport.ledger import RateLimiter
from ravnest_p2p.transport.limits import (
    GOSSIP_MAX_BUCKETS,
    GOSSIP_MAX_ITEMS,
    GOSSIP_MAX_MESSAGE_BYTES,
    GOSSIP_PEER_ID_MAX_CHARS,
)

__all__ = ["GOSSIP_VIEW", "GossipItem", "GossipLimits", "GossipReply", "GossipRequest", "Gossiper"]

logger = logging.getLogger(__name__)

# derived in transport/limits.py so that a message at these caps fits its envelope's header
MAX_BUCKETS = GOSSIP_MAX_BUCKETS
MAX_ITEMS = GOSSIP_MAX_ITEMS
_Hex16 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
_Hex64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
# a peer id as membership messages carry it (gossip items, suspect reports): one bound for both
PeerIdText = Annotated[
    str, StringConstraints(min_length=1, max_length=GOSSIP_PEER_ID_MAX_CHARS, pattern=r"^[A-Za-z0-9_-]+$")
]


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)


class GossipItem(_Msg):
    peer_id: PeerIdText
    version: float = Field(ge=0, le=1e12)
    digest: Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{16})?$")]

    def to_summary(self) -> SummaryItem:
        return SummaryItem(self.peer_id, self.version, self.digest)

    @classmethod
    def of(cls, item: SummaryItem) -> GossipItem:
        return cls(peer_id=item.peer_id, version=item.version, digest=item.digest)


class GossipRequest(_Msg):
    epoch: int = Field(ge=0, le=2**62)
    suspects_version: int = Field(default=0, ge=0, le=2**62)  # the sender's published suspect reports
    view_digest: _Hex64
    bucket_digests: tuple[_Hex16, ...] = Field(max_length=MAX_BUCKETS)
    push_buckets: tuple[int, ...] = Field(default=(), max_length=MAX_BUCKETS)
    push: tuple[GossipItem, ...] = Field(default=(), max_length=MAX_ITEMS)


class GossipReply(_Msg):
    epoch: int = Field(ge=0, le=2**62)
    suspects_version: int = Field(default=0, ge=0, le=2**62)
    view_digest: _Hex64
    differing: tuple[int, ...] = Field(default=(), max_length=MAX_BUCKETS)
    entries: tuple[GossipItem, ...] = Field(default=(), max_length=MAX_ITEMS)


GOSSIP_VIEW = RpcMethod(
    "gossip_view",
    GossipRequest,
    GossipReply,
    max_request_bytes=GOSSIP_MAX_MESSAGE_BYTES,
    max_response_bytes=GOSSIP_MAX_MESSAGE_BYTES,
    max_tensors=0,
    handler_timeout_s=5.0,
)

NewsHandler = Callable[[str, list[SummaryItem]], None]


@dataclass(frozen=True)
class GossipLimits:
    """Requests per second we answer: per member, per stranger, and for all strangers together."""

    member_rate_per_s: float = 8.0
    member_burst: float = 16.0
    stranger_rate_per_s: float = 1.0
    stranger_burst: float = 4.0
    strangers_rate_per_s: float = 16.0
    strangers_burst: float = 32.0

    def scaled(self, period_s: float) -> GossipLimits:
        """The same limits per gossip period of ``period_s`` instead of per second."""
        return GossipLimits(
            member_rate_per_s=self.member_rate_per_s / period_s,
            member_burst=self.member_burst,
            stranger_rate_per_s=self.stranger_rate_per_s / period_s,
            stranger_burst=self.stranger_burst,
            strangers_rate_per_s=self.strangers_rate_per_s / period_s,
            strangers_burst=self.strangers_burst,
        )


def _check_items(items: Sequence[GossipItem], buckets: Sequence[int], num_buckets: int) -> None:
    if any(not 0 <= b < num_buckets for b in buckets):
        raise InvalidMessage("bucket index out of range")
    allowed = set(buckets)
    if any(bucket_of(item.peer_id, num_buckets) not in allowed for item in items):
        raise InvalidMessage("item outside the buckets it claims")
    if len({item.peer_id for item in items}) != len(items):
        raise InvalidMessage("duplicate peer ids")


def _fit_buckets(
    buckets: Sequence[int], items_of: Callable[[list[int]], list[SummaryItem]], max_items: int
) -> tuple[list[int], list[SummaryItem]]:
    """The longest prefix of `buckets` whose items fit one message (`max_items`), and those items.

    A view of more peers than a message holds reconciles over several rounds, a prefix of the differing
    buckets at a time, instead of sending a message the receiver must refuse. One bucket larger than a
    message (more than ``max_items x num_buckets`` peers) cannot converge: raise ``num_buckets``.
    """
    kept: list[int] = []
    items: list[SummaryItem] = []
    for bucket in buckets:
        more = items_of([bucket])
        if len(items) + len(more) > max_items:
            break
        kept.append(bucket)
        items.extend(more)
    return kept, items


class Gossiper:
    """Runs the `gossip_view` protocol for one view.

    Args:
        rpc: our endpoint.
        view: the view we describe (read-only here; ``on_news`` decides what changes it).
        get_epoch: our current epoch.
        on_epoch: called with ``(sender, epoch)`` for a higher epoch a peer claims (a claim only).
        on_news: called with ``(sender, items)`` when a peer told us something newer than our view.
        fanout: peers contacted per round.
        call_timeout_s: deadline of each call.
        limits: rate limits of served requests (None: unlimited, e.g. in the simulator).
        is_member: whether a sender holds a valid signed record in our directory (for ``limits``).
        clock: monotonic seconds (for ``limits``).
    """

    def __init__(
        self,
        rpc: RpcEndpoint,
        view: MembershipView,
        *,
        get_epoch: Callable[[], int],
        on_epoch: Callable[[str, int], None],
        on_news: NewsHandler,
        fanout: int = 3,
        call_timeout_s: float = 2.0,
        rng: random.Random | None = None,
        limits: GossipLimits | None = None,
        is_member: Callable[[str], bool] = lambda _peer_id: True,
        clock: Callable[[], float] = time.monotonic,
        get_suspects_version: Callable[[], int] = lambda: 0,
        on_suspects_version: Callable[[str, int], None] = lambda _peer_id, _version: None,
    ) -> None:
        self.rpc = rpc
        self.view = view
        self._get_epoch = get_epoch
        self._on_epoch = on_epoch
        self._on_news = on_news
        self.fanout = fanout
        self.call_timeout_s = call_timeout_s
        self._rng = rng or random.Random()
        self.bytes_sent = 0
        self.num_contacts = 0
        self.num_failures = 0
        self._is_member = is_member
        self._clock = clock
        self._get_suspects_version = get_suspects_version
        self._on_suspects_version = on_suspects_version
        self._limits = limits
        if limits is not None:
            self._member_limiter = RateLimiter(rate_per_s=limits.member_rate_per_s, burst=limits.member_burst)
            self._stranger_limiter = RateLimiter(
                rate_per_s=limits.stranger_rate_per_s, burst=limits.stranger_burst
            )
            self._strangers_limiter = RateLimiter(
                rate_per_s=limits.strangers_rate_per_s, burst=limits.strangers_burst
            )
        self.num_rate_limited = 0

    def _admit(self, sender: str) -> None:
        if self._limits is None:
            return
        now = self._clock()
        if self._is_member(sender):
            allowed = self._member_limiter.allow(sender, now)
        else:
            allowed = self._stranger_limiter.allow(sender, now) and self._strangers_limiter.allow("*", now)
        if not allowed:
            self.num_rate_limited += 1
            raise RateLimited(f"too many gossip requests from {sender}")

    async def serve(self) -> None:
        await self.rpc.serve(GOSSIP_VIEW, self._handle)

    async def unserve(self) -> None:
        await self.rpc.unserve(GOSSIP_VIEW)

    def _hear(self, sender: str, epoch: int, items: Sequence[GossipItem]) -> None:
        if epoch > self._get_epoch():
            self._on_epoch(sender, epoch)
        news = [i.to_summary() for i in items if self.view.is_news(i.to_summary())]
        if news:
            self._on_news(sender, news)

    async def _handle(self, request: GossipRequest, tensors: object, ctx: CallContext) -> GossipReply:
        self._admit(ctx.remote_peer_id)
        num_buckets = self.view.num_buckets
        if len(request.bucket_digests) != num_buckets:
            raise InvalidMessage(f"{len(request.bucket_digests)} bucket digests, expected {num_buckets}")
        _check_items(request.push, request.push_buckets, num_buckets)
        self._hear(ctx.remote_peer_id, request.epoch, request.push)
        if request.suspects_version:
            self._on_suspects_version(ctx.remote_peer_id, request.suspects_version)
        reply_epoch, digest, version = self._get_epoch(), self.view.digest(), self._get_suspects_version()
        if request.push_buckets or request.view_digest == digest:
            return GossipReply(epoch=reply_epoch, view_digest=digest, suspects_version=version)
        differing, items = _fit_buckets(
            self.view.differing_buckets(request.bucket_digests), self.view.summary, MAX_ITEMS
        )
        entries = tuple(GossipItem.of(i) for i in items)
        return GossipReply(
            epoch=reply_epoch,
            view_digest=digest,
            differing=tuple(differing),
            entries=entries,
            suspects_version=version,
        )

    def _request(self, push_buckets: Sequence[int] = (), push: Sequence[SummaryItem] = ()) -> GossipRequest:
        return GossipRequest(
            epoch=self._get_epoch(),
            view_digest=self.view.digest(),
            bucket_digests=tuple(self.view.bucket_digests()),
            push_buckets=tuple(push_buckets),
            push=tuple(GossipItem.of(i) for i in push),
            suspects_version=self._get_suspects_version(),
        )

    async def exchange(self, peer_id: str) -> bool:
        """One push-pull contact; True if the views' digests were already equal."""
        request = self._request()
        self.bytes_sent += len(request.model_dump_json())
        reply = (await self.rpc.call(peer_id, GOSSIP_VIEW, request, timeout_s=self.call_timeout_s)).message
        self.num_contacts += 1
        if reply.suspects_version:
            self._on_suspects_version(peer_id, reply.suspects_version)
        if reply.view_digest == request.view_digest and not reply.differing:
            if reply.epoch > self._get_epoch():
                self._on_epoch(peer_id, reply.epoch)
            return True
        try:
            _check_items(reply.entries, reply.differing, self.view.num_buckets)
        except InvalidMessage as exc:
            raise TransportError(f"malformed gossip reply from {peer_id}: {exc}") from None
        remote = [i.to_summary() for i in reply.entries]
        they_need, _ = self.view.diff(remote, reply.differing)
        self._hear(peer_id, reply.epoch, reply.entries)
        if they_need or reply.epoch < self._get_epoch():
            need: dict[int, list[SummaryItem]] = {}
            for item in they_need:
                need.setdefault(bucket_of(item.peer_id, self.view.num_buckets), []).append(item)
            buckets, items = _fit_buckets(
                list(reply.differing), lambda bs: [i for b in bs for i in need.get(b, [])], MAX_ITEMS
            )
            push = self._request(buckets, items)
            self.bytes_sent += len(push.model_dump_json())
            await self.rpc.call(peer_id, GOSSIP_VIEW, push, timeout_s=self.call_timeout_s)
        return False

    async def gossip_round(self, candidates: Sequence[str]) -> int:
        """Contact up to ``fanout`` random ``candidates`` concurrently; returns how many answered."""
        chosen = self._rng.sample(list(candidates), min(self.fanout, len(candidates)))
        results = await asyncio.gather(*(self.exchange(pid) for pid in chosen), return_exceptions=True)
        answered = 0
        for pid, result in zip(chosen, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, TransportError):
                self.num_failures += 1
                logger.debug("gossip with %s failed: %s", pid, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                answered += 1
        return answered
