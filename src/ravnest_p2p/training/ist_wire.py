"""Wire records of IST over the network (`training.ist_runner`), and the checks of a reply's tensors.

One method carries a round: at the start of round r, worker i sends `IstPull` to every other live worker
j ("the entries of my round-r sub-network that you hold, and your shared tensors"); j answers with
`IstParts` once it has finished round r - 1, with one flat tensor per dealt tensor of the model (the
entries, in the order of `strategies.ist_blocks.subnet_indices` restricted to j's holdings) and its copy
of the shared tensors. Both sides compute the masks themselves from the deal, so the reply carries no
indices: the requester knows how many entries of each tensor must come back.

Agreement without a coordinator: every request carries the requester's deal (`live`: the workers the
round's hidden units are dealt to), the workers whose holdings it treats as lost (`gone`: their entries
come from the previous holder) and the deaths it knows (`dead`: worker -> first round without it). The
holder merges the deaths and answers `mismatch` (with its own deaths) when its deal for the round still
differs; the requester merges them and pulls again.

Everything from the network is checked before use: bodies by pydantic (strict numbers, bounded lists),
worker indices against the job, the reply's round, tensor count, shapes (1-D of the expected length),
dtypes and finiteness (`check_parts`); tensors are decoded by the codec, never unpickled.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
from pydantic import Field

from ravnest_p2p.errors import InvalidMessage
from ravnest_p2p.training.sync_wire import check_tensors
from ravnest_p2p.transport.limits import MIB
from ravnest_p2p.transport.rpc import RpcMethod
from ravnest_p2p.types import WireModel

__all__ = ["IST_PULL", "IstParts", "IstPull", "PartsKind", "check_parts"]

_MAX_WORKERS = 1024
_MAX_TENSORS = 1024
_WORKER = Field(ge=0, lt=_MAX_WORKERS)


class PartsKind(enum.StrEnum):
    PARTS = "parts"  # the entries and shared tensors are attached
    PENDING = "pending"  # the holder has not finished the previous round within `wait_s`
    MISMATCH = "mismatch"  # the holder deals the round to other workers: merge `dead` and pull again


class IstPull(WireModel):
    """Worker i asks a holder for its entries of i's sub-network of `round`.

    Attributes:
        job_id: the job.
        round: the round the requester is about to train (`final`: the round after the last one, the
            whole model is gathered).
        final: gather every entry (for the evaluation after the last round), not a sub-network.
        live: the job's worker indices the round is dealt to, ascending (the requester's deal).
        gone: workers whose holdings the requester treats as lost this round (ascending).
        dead_workers / dead_since: deaths the requester knows: worker, first round without it.
        wait_s: how long the holder may wait for its previous round to finish before answering pending.
    """

    schema_version: int = 1
    job_id: str = Field(min_length=1, max_length=64)
    round: int = Field(ge=0, le=2**31)
    final: bool = False
    live: tuple[int, ...] = Field(min_length=1, max_length=_MAX_WORKERS)
    gone: tuple[int, ...] = Field(default=(), max_length=_MAX_WORKERS)
    dead_workers: tuple[int, ...] = Field(default=(), max_length=_MAX_WORKERS)
    dead_since: tuple[int, ...] = Field(default=(), max_length=_MAX_WORKERS)
    wait_s: float = Field(default=10.0, ge=0, le=600)


class IstParts(WireModel):
    """The holder's answer: `num_dealt` flat entry tensors, then `num_shared` shared tensors."""

    schema_version: int = 1
    kind: PartsKind
    round: int = Field(ge=0, le=2**31)
    num_dealt: int = Field(default=0, ge=0, le=_MAX_TENSORS)
    num_shared: int = Field(default=0, ge=0, le=_MAX_TENSORS)
    dead_workers: tuple[int, ...] = Field(default=(), max_length=_MAX_WORKERS)
    dead_since: tuple[int, ...] = Field(default=(), max_length=_MAX_WORKERS)


# a reply is at most the whole model (the final gather): wide_mlp at width 4096 is ~70 MiB in fp32
IST_PULL = RpcMethod(
    "ist_pull",
    IstPull,
    IstParts,
    max_request_bytes=64 * 1024,
    max_response_bytes=512 * MIB,
    max_tensors=0,
    large_response=True,
    handler_timeout_s=620.0,  # bounded by the request's wait_s
)


def check_parts(
    reply: IstParts,
    tensors: Sequence[torch.Tensor],
    *,
    round_index: int,
    counts: Sequence[int],
    dealt_dtypes: Sequence[torch.dtype],
    shared: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(entries per dealt tensor, shared tensors) of a `parts` reply, if it is exactly what was asked.

    Args:
        reply / tensors: the holder's answer.
        round_index: the round asked for.
        counts: how many entries of each dealt tensor the holder must send (the requester's masks).
        dealt_dtypes: each dealt tensor's dtype.
        shared: the requester's own shared tensors (shapes and dtypes to match).

    Raises:
        InvalidMessage: another round or kind, a wrong count, shape, dtype, or a non-finite value.
    """
    if reply.kind != PartsKind.PARTS:
        raise InvalidMessage(f"expected parts, got {reply.kind}")
    if reply.round != round_index:
        raise InvalidMessage(f"parts of round {reply.round}, asked for round {round_index}")
    if reply.num_dealt != len(counts) or reply.num_shared != len(shared):
        raise InvalidMessage(
            f"{reply.num_dealt}+{reply.num_shared} tensors announced, expected {len(counts)}+{len(shared)}"
        )
    names = [f"d{k}" for k in range(len(counts))] + [f"s{k}" for k in range(len(shared))]
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        f"d{k}": ((n,), dtype) for k, (n, dtype) in enumerate(zip(counts, dealt_dtypes, strict=True))
    }
    expected |= {f"s{k}": (tuple(t.shape), t.dtype) for k, t in enumerate(shared)}
    values = check_tensors(names, tensors, expected, what=f"IST parts of round {round_index}")
    return [values[f"d{k}"] for k in range(len(counts))], [values[f"s{k}"] for k in range(len(shared))]
