"""The commit rule of a ring attempt: once one member holds the whole mean, every survivor applies it.

Problem. A ring attempt "completes" at a member when every part arrived *and* its right neighbour
acknowledged every part it sent. The two are not the same moment at every member: a member that dies
right after its last send lets its successors complete, while its predecessor, whose last parts were
never acknowledged, fails. Before this rule the failed member re-formed the ring with the survivors,
found them done, and kept its own values: the survivors then differed by one round (for the outer
optimizer: one outer step, so their anchors were no longer bit-identical). The victim's Δ was in the
mean the others applied, so "drop out of the sync" was true at some replicas and not at others.

The rule (decided per ring attempt, the same at every survivor):

- an attempt is *committed* as soon as any member holds its whole mean (every part arrived; acks are
  about the neighbour, not about the data). A committed attempt's mean is applied by every survivor of
  that attempt, never a different one;
- a member whose attempt failed with the whole mean in hand applies it at once (`RingSession.complete`;
  only acks were missing);
- a member whose attempt failed without it probes the members (`reform.py`); a reply that holds the
  failed attempt's mean (`StatusReply.holds`, same members) makes it fetch that mean (`ring_result`,
  1 MiB slices, checked: fp32, the slice's shape, finite) instead of forming the next attempt. Every
  holder has the same bits (the all-gather forwards the owners' values or bytes verbatim), so it does not
  matter which one answers. With a lossy Δ codec the fetcher's own rounding residual is complete too:
  a whole mean somewhere means every chunk was reduced, so every member made all its encodings;
- if nobody that answers holds it, the attempt is not committed anywhere alive: the survivors form the
  next attempt without the dead member (its Δ drops out of this sync at every survivor), as before;
- a member the others left out (late: they formed a later attempt without it) may fetch that attempt's
  mean too (`adopt_late`, the outer optimizer's syncs): its own Δ is not in it, but it takes the same
  outer step as the others, so the anchors stay bit-identical, and its Δ goes into its next sync
  (`OuterOptimizer.step_late`). Any member of the shard's ring may fetch; strangers may not.

Why this and not a commit/ack round after the all-gather: a round of acks cannot make the last ack
certain (two generals); its failure case is the same "some have it, some do not", which again needs a
transfer of the mean. Fetching from a holder closes the gap with no extra message in the good case.
The probe that reports `holds` is also what stops a member still running the attempt, so a member's
answer is final: after a probe stopped it, it can no longer become a holder. Why the whole mean and not
resuming the next attempt from partial sums: see `ring.py` ("Alternatives rejected").

Memory: a holder keeps the mean (a copy of the shard: the averaged tensors handed out are views of
it) until this ring's next round starts there, at most three step deadlines (`RingAllReduce._linger`).

Limits. A late member can fetch only while a holder keeps the mean (three step deadlines after the
round): a member later than that keeps its values and its anchor falls behind. A holder that dies
between answering a probe and serving the fetch: the fetcher tries the other holders, then keeps
its own values for the round (a second fault in the same window); so does a fetch
that outlasts the holder's three step deadlines (a very large shard on a slow link). A member that a
probe could not reach but that is alive and holds the mean applies it while the others form a new
attempt without it (a partition, not a crash): its replica then differs by that round until the next
sync that includes it; the closing round is a plain average, so replicas still end identical.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ravnest_p2p.averaging.base import RingConfig
from ravnest_p2p.averaging.messages import RESULT_CHUNK_NUMEL, RING_RESULT, ResultReply, ResultRequest
from ravnest_p2p.averaging.session import RingSession
from ravnest_p2p.errors import InvalidMessage, TransportError
from ravnest_p2p.transport import RpcEndpoint

__all__ = ["fetch_result", "result_slice"]

logger = logging.getLogger(__name__)


def result_slice(session: RingSession | None, req: ResultRequest, requester: str) -> torch.Tensor | None:
    """The requested slice of the mean this member holds, or None if it holds no such mean.

    A member whose attempt is complete but still running (waiting for its neighbour's acks) serves it
    from the accumulator: x / n is correctly rounded, so the slice has the bits `average` will give.

    Raises:
        InvalidMessage: the requester was not a member of that attempt, or the slice is out of range.
    """
    if session is None or (session.epoch, session.round) != (req.epoch, req.round):
        return None
    if session.holds != req.attempt or req.attempt < 0:
        return None
    if requester not in session.members and requester not in session.ring:  # a late ring member may
        raise InvalidMessage(f"{req.ring_id}: {requester} was not in attempt {req.attempt}")
    if req.offset + req.numel > session.numel:
        raise InvalidMessage(f"{req.ring_id}: [{req.offset}, +{req.numel}) beyond {session.numel}")
    lo, hi = req.offset, req.offset + req.numel
    if session.result is not None:
        return session.result[lo:hi].clone()
    return session.acc[lo:hi] / session.size


async def fetch_result(
    endpoint: RpcEndpoint,
    session: RingSession,
    holders: Sequence[str],
    config: RingConfig,
    *,
    attempt: int | None = None,
) -> torch.Tensor | None:
    """The mean of `session`'s current attempt (or of `attempt`, one made without this member) from the
    first of `holders` that serves all of it.

    Returns None if none does (each holder gets `config.step_timeout_s` per slice).
    """
    attempt = session.attempt if attempt is None else attempt
    for holder in holders:
        mean = torch.empty(session.numel)
        try:
            for offset in range(0, session.numel, RESULT_CHUNK_NUMEL):
                count = min(RESULT_CHUNK_NUMEL, session.numel - offset)
                request = ResultRequest(
                    ring_id=session.ring_id,
                    epoch=session.epoch,
                    round=session.round,
                    attempt=attempt,
                    offset=offset,
                    numel=count,
                )
                reply = await endpoint.call(holder, RING_RESULT, request, timeout_s=config.step_timeout_s)
                mean[offset : offset + count] = _checked(reply.message, reply.tensors, count)
        except (TransportError, InvalidMessage, TimeoutError) as exc:
            logger.info("ring %s: fetching the mean from %s failed: %r", session.ring_id, holder, exc)
            continue
        logger.info(
            "ring %s round %d: attempt %d's mean fetched from %s",
            session.ring_id,
            session.round,
            attempt,
            holder,
        )
        return mean
    return None


def _checked(reply: ResultReply, tensors: list[torch.Tensor], count: int) -> torch.Tensor:
    if not reply.available or len(tensors) != 1:
        raise InvalidMessage("the mean is not available there")
    (tensor,) = tensors
    if tensor.dtype != torch.float32 or tuple(tensor.shape) != (count,):
        raise InvalidMessage(f"got {tensor.dtype} {tuple(tensor.shape)}, want ({count},)")
    if not bool(torch.isfinite(tensor).all()):
        raise InvalidMessage("non-finite values")
    return tensor
