"""One IST worker's state over the network: its replica, who holds what, and the `ist_pull` handler.

Every worker keeps a full-size replica of the `wide_mlp`, current only where it holds the entries
(`strategies.ist_blocks.Holders`). After committing round r it serves round r + 1's pulls from it: the
entries of the requester's round r + 1 sub-network it holds, and its shared tensors as of round r. It
may run one round ahead of a requester: its own next write-back touches only its own next sub-network,
disjoint from the requester's, so the entries it serves are never overwritten before they are asked for
(and the holder maps of the last few rounds are kept to answer a late requester).

Deaths: `dead_since[w]` is the first round that is not dealt to worker w. The worker that finds w
unreachable during round r sets it to r + 1 (the round goes on with w's part untrained and w's holdings
fetched from their previous holders), and every request and reply carries the deaths, merged by min.
A death dated at or before a round this worker already committed means the workers disagreed on a
deal: the job fails with that reason instead of training on two different deals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ravnest_p2p.errors import InvalidMessage, RavnestError
from ravnest_p2p.strategies.ist import IstDeal, deal_hidden_units, hidden_sizes
from ravnest_p2p.strategies.ist_blocks import EVERYONE, Holders, model_tensors, subnet_indices
from ravnest_p2p.training.ist_wire import IstParts, IstPull, PartsKind
from ravnest_p2p.transport.rpc import CallContext

__all__ = ["IstState", "LeftJob"]

logger = logging.getLogger(__name__)

# a dead worker's holdings fall back along the holder maps of this many earlier rounds; both sides of a
# pull must use the same chain, so it is fixed by the round asked for, and every worker keeps the maps a
# requester may still ask about (a holder is at most one round ahead of a requester)
_FALLBACK_ROUNDS = 4
_KEEP_ROUNDS = _FALLBACK_ROUNDS + 2


class LeftJob(RavnestError):
    """This worker was declared dead by another (unreachable or too slow for a while): it must stop."""


class IstState:
    """A worker's replica, holder maps, shared snapshots and deaths (see module docstring).

    Args:
        job_id: the job.
        workers: the job's workers (peer ids), in assignment order: a worker's index is its identity.
        me: this peer's index in `workers`.
        layers: the full model, built from the job seed (identical on every worker).
        seed: the job seed (seeds every round's deal).
        num_rounds: rounds of the job; round `num_rounds` is the final gather.
    """

    def __init__(
        self,
        job_id: str,
        workers: Sequence[str],
        me: int,
        layers: Sequence[nn.Module],
        *,
        seed: int,
        num_rounds: int,
    ) -> None:
        self.job_id, self.workers, self.me = job_id, tuple(workers), me
        self.layers = list(layers)
        self.tensors = model_tensors(self.layers)
        self.sizes = hidden_sizes(self.layers)
        self.seed, self.num_rounds = seed, num_rounds
        self.committed = -1  # the last round whose sub-network this worker wrote back
        self.holders: dict[int, Holders] = {-1: Holders.initial(self.tensors)}
        self.shared: dict[int, list[Tensor]] = {-1: [t.clone() for t in self.tensors.shared]}
        self.dealt_to: dict[int, tuple[int, ...]] = {}
        self.dead_since: dict[int, int] = {}
        self.evicted: str | None = None
        self._changed = asyncio.Event()  # set (and replaced) whenever the state changes
        self.final_served: set[int] = set()

    # ----- membership -------------------------------------------------------------------------------
    def live(self, round_index: int) -> tuple[int, ...]:
        """The workers round ``round_index`` is dealt to (ascending)."""
        return tuple(w for w in range(len(self.workers)) if self.dead_since.get(w, 1 << 62) > round_index)

    def gone(self) -> set[int]:
        return set(self.dead_since)

    def deaths(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        items = sorted(self.dead_since.items())
        return tuple(w for w, _ in items), tuple(s for _, s in items)

    def learn(self, workers: Sequence[int], since: Sequence[int]) -> bool:
        """Merge deaths (worker, first round without it); whether anything changed.

        Raises:
            LeftJob: this worker was declared dead.
            RavnestError: a death contradicts a deal this worker committed.
        """
        if len(workers) != len(since):
            raise InvalidMessage("dead workers and rounds differ in length")
        changed = False
        for worker, first in zip(workers, since, strict=True):
            if not 0 <= worker < len(self.workers) or first < 0:
                raise InvalidMessage(f"bad death ({worker}, {first})")
            if first >= self.dead_since.get(worker, 1 << 62):
                continue
            if worker == self.me:
                self.evicted = f"declared dead from round {first} by another worker"
                raise LeftJob(f"worker {self.me} left the job: {self.evicted}")
            committed = [r for r, dealt in self.dealt_to.items() if r >= first and worker in dealt]
            if committed:
                raise RavnestError(
                    f"workers disagree on round {min(committed)}'s deal: worker {worker} is dead from "
                    f"round {first} for another worker, this one trained with it"
                )
            self.dead_since[worker] = first
            changed = True
        return changed

    # ----- deals and holdings ------------------------------------------------------------------------
    def deal(self, round_index: int, live: Sequence[int]) -> IstDeal:
        return deal_hidden_units(self.sizes, len(live), round_index=round_index, seed=self.seed)

    def holders_for(self, round_index: int, gone: Sequence[int]) -> Holders:
        """Holders of the entries at the start of ``round_index``, with the ``gone`` workers' fallen back."""
        latest = self.holders[round_index - 1]
        older = [
            self.holders[r] for r in range(round_index - 2, max(-2, round_index - 2 - _FALLBACK_ROUNDS), -1)
        ]
        return latest.without(gone, older)

    def wanted(self, round_index: int, live: Sequence[int], requester: int, *, final: bool) -> list[Tensor]:
        """Flat indices, per dealt tensor, that ``requester`` needs at the start of ``round_index``."""
        if final:
            return [torch.arange(t.numel()) for t in self.tensors.dealt]
        return subnet_indices(self.layers, self.deal(round_index, live), live.index(requester))

    def masks(
        self,
        round_index: int,
        live: Sequence[int],
        gone: Sequence[int],
        requester: int,
        holders_of: Sequence[int],
        *,
        final: bool,
    ) -> tuple[list[Tensor], dict[int, list[Tensor]]]:
        """(indices ``requester`` needs, per holder the mask over them of the entries that holder sends)."""
        indices = self.wanted(round_index, live, requester, final=final)
        holders = self.holders_for(round_index, gone)
        masks = {h: holders.held_by(indices, h) for h in holders_of}
        if final:  # entries everyone has a copy of come from one worker, so every final model is equal
            first = min(w for w in live if w not in set(gone))
            if first in masks:
                masks[first] = [
                    m | (holders.maps[k][i] == EVERYONE)
                    for k, (m, i) in enumerate(zip(masks[first], indices, strict=True))
                ]
        return indices, masks

    def commit(
        self, round_index: int, live: tuple[int, ...], deal: IstDeal, sub: Sequence[nn.Module]
    ) -> None:
        """Write our trained sub-network into the replica and record round ``round_index``'s holders."""
        position = live.index(self.me)
        indices = subnet_indices(self.layers, deal, position)
        trained = model_tensors(sub)
        with torch.no_grad():
            for full, index, part in zip(self.tensors.dealt, indices, trained.dealt, strict=True):
                full.view(-1)[index] = part.reshape(-1)
            for full, part in zip(self.tensors.shared, trained.shared, strict=True):
                full.copy_(part)
        self.holders[round_index] = self.holders[round_index - 1].assign(self.layers, deal, live)
        self.shared[round_index] = [t.clone() for t in self.tensors.shared]
        self.dealt_to[round_index] = live
        for old in [r for r in self.holders if r < round_index - _KEEP_ROUNDS]:
            del self.holders[old]
            self.shared.pop(old, None)
        self.committed = round_index

    # ----- the handler -------------------------------------------------------------------------------
    async def notify(self) -> None:
        """Wake everything waiting for a change (a commit, a death, a final pull served)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``predicate()`` holds (re-checked on every `notify`); False after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not predicate():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    async def handle_pull(
        self, request: IstPull, tensors: list[Tensor], context: CallContext
    ) -> tuple[IstParts, list[Tensor]]:
        if request.job_id != self.job_id:
            raise InvalidMessage(f"not job {request.job_id!r}")
        if context.remote_peer_id not in self.workers:
            raise InvalidMessage("the sender is not a worker of the job")
        if self.evicted is not None:
            raise InvalidMessage(f"this peer left the job: {self.evicted}")
        requester = self.workers.index(context.remote_peer_id)
        if request.final != (request.round == self.num_rounds) or request.round > self.num_rounds:
            raise InvalidMessage(f"round {request.round} (final {request.final}) of {self.num_rounds}")
        _check_workers(request.live, len(self.workers), "live")
        _check_workers(request.gone, len(self.workers), "gone")
        if requester not in request.live or requester in request.gone:
            raise InvalidMessage("the requester is not dealt the round")
        if self.me in request.gone:
            raise InvalidMessage("this worker is gone for the requester")
        if self.learn(request.dead_workers, request.dead_since):
            await self.notify()
        if requester in self.dead_since and self.dead_since[requester] <= request.round:
            raise InvalidMessage(
                f"worker {requester} was declared dead from round {self.dead_since[requester]}"
            )
        ready = await self._wait_committed(request.round - 1, request.wait_s)
        workers, since = self.deaths()
        if not ready:
            return IstParts(
                kind=PartsKind.PENDING, round=request.round, dead_workers=workers, dead_since=since
            ), []
        if any(
            r not in self.holders for r in range(max(-1, request.round - 1 - _FALLBACK_ROUNDS), request.round)
        ):
            raise InvalidMessage(f"round {request.round} is too old (this worker is at {self.committed})")
        if tuple(request.live) != self.live(request.round):
            return IstParts(
                kind=PartsKind.MISMATCH, round=request.round, dead_workers=workers, dead_since=since
            ), []
        indices, by_holder = self.masks(
            request.round, request.live, request.gone, requester, [self.me], final=request.final
        )
        masks = by_holder[self.me]
        out = [
            full.reshape(-1)[index[mask]].clone()
            for full, index, mask in zip(self.tensors.dealt, indices, masks, strict=True)
        ]
        out += [t.clone() for t in self.shared[request.round - 1]]
        if request.final:
            self.final_served.add(requester)
            await self.notify()
        message = IstParts(
            kind=PartsKind.PARTS,
            round=request.round,
            num_dealt=len(self.tensors.dealt),
            num_shared=len(self.tensors.shared),
            dead_workers=workers,
            dead_since=since,
        )
        return message, out

    async def _wait_committed(self, round_index: int, wait_s: float) -> bool:
        ready = await self.wait_for(lambda: self.committed >= round_index or self.evicted is not None, wait_s)
        if self.evicted is not None:
            raise InvalidMessage(f"this peer left the job: {self.evicted}")
        return ready


def _check_workers(workers: Sequence[int], count: int, what: str) -> None:
    if any(not 0 <= w < count for w in workers) or list(workers) != sorted(set(workers)):
        raise InvalidMessage(f"{what}: {list(workers)[:8]} are not ascending worker indices of the job")
