"""Layout of synchronous SGD with backup workers over peers: shards, their owners, each worker's batches.

Problem. N + b workers each hold the whole model; its parameters are cut into shards and every shard has
one owner that aggregates that shard's gradients each step. Every worker must compute the same layout
without a message, and when an owner dies the layout must change as little as possible: the survivors
keep the shards they own (their aggregation state stays valid) and only the dead owner's shards move.

Choices.
- Shards: parameter tensors, packed largest first into the currently smallest shard (ties by shard
  index), so shards carry similar byte counts; names keep model order inside a shard. A tensor larger
  than `MIN_PIECE_BYTES` and a quarter of a fair shard (model bytes / shards) is first cut into row
  ranges of about that quarter (`row_pieces`, named ``name[start:end]``): one 2048x2048 matrix holds
  96 % of a wide MLP, and whole tensors put it on one owner, which then receives (N + b - 1) x 16.8 MB
  per step while the others idle; in digits_cnn one 256 KB matrix is 77 % of the model, and its
  owner's link set the step's exchange time on the lab. A row range of a contiguous tensor is a
  contiguous view, so the worker slices without copies, and every optimizer we offer is element-wise,
  so stepping the pieces is stepping the tensor. Tensors up to 64 KiB stay whole.
- Owners: a balanced deal, then rendezvous hashing for the dead owners' shards. Shards are dealt
  largest first, each to the candidate with the fewest bytes so far (ties by a hash of (job, peer)),
  so with one shard per candidate (the runner's default) every candidate owns exactly one, and with
  more shards the owners' bytes stay within one shard of each other. Every peer computes the deal from
  the job id, the candidates and the shard sizes alone. A shard whose dealt owner is dead goes to the
  rendezvous (highest-random-weight) winner of (job, shard) among the live candidates: a shard moves
  only when the peer that holds it dies, whatever the order of deaths, which every peer computes alike
  from the same dead set. Rejected: rendezvous hashing alone (the previous layout) gave some owner two
  of n shards for most job ids (91 % at n = 4), and that owner's link carried twice its share every
  step; a re-deal over the survivors would balance again after a death but move shards of live owners
  (their aggregation state lost); a round-robin by worker index moves almost every shard when one
  worker leaves.
- Owner candidates: the job may restrict ownership to some workers (fast, well-connected peers): an
  owner on a slow peer delays every step's replies (measured on the lab: a straggler that owned one
  of five shards made the step 1.73x the N-th order statistic instead of 1.2x). If every candidate
  is dead, every live worker becomes a candidate again: a smaller set must never stop the job.
- Batches: worker w at step t trains batch slot t·(N+b) + w of one seeded shuffle per data epoch, so
  with b = 0 the step's large batch is exactly the union of the N workers' batches (what the
  single-process reference in the tests trains on), and a worker that skips steps (a straggler that
  catches up) knows its batch for any step without replaying the data stream.

Source: Chen et al., arXiv 1604.00981 (parameter servers; we put the servers on the workers). Known
limits: the layout does not weigh owners by their link rates or speed itself; the job's candidates are
chosen by whoever writes the job (the planner does not yet). After a death the dead owner's shards
land where the hash puts them: with one shard per candidate, one survivor then owns two.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
from collections.abc import Collection, Mapping, Sequence

__all__ = [
    "MIN_PIECE_BYTES",
    "RowPiece",
    "SyncLayout",
    "batch_slot",
    "deal_owners",
    "owner_of",
    "row_pieces",
    "shard_parameters",
]

MIN_PIECE_BYTES = 1 << 16  # tensors up to this size are never cut


@dataclasses.dataclass(frozen=True)
class RowPiece:
    """Rows [start, end) of parameter `tensor` (all of it when it is not cut), shard name `name`."""

    name: str
    tensor: str
    start: int
    end: int


def row_pieces(
    shapes: Mapping[str, tuple[int, int]], num_shards: int, *, min_piece_bytes: int = MIN_PIECE_BYTES
) -> list[RowPiece]:
    """Cut the tensors (name -> (bytes, rows), model order) above `min_piece_bytes` into row ranges.

    The target piece is a quarter of a fair shard (total / num_shards / 4): fine enough that packing
    largest first evens the shards out (a shard's pieces travel in one message, so finer pieces cost no
    extra messages). A tensor of B bytes and R >= 2 rows with B > max(target, min_piece_bytes) becomes
    ceil(B / target) (at most R) ranges of near-equal row counts; every other tensor is one piece, named
    as the tensor. Pieces come in model order.

    Raises:
        ValueError: `num_shards` < 1.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    total = sum(size for size, _ in shapes.values())
    target = max(1, -(-total // (4 * num_shards)))
    pieces = []
    for name, (size, rows) in shapes.items():
        count = min(rows, -(-size // target)) if size > max(target, min_piece_bytes) and rows >= 2 else 1
        if count == 1:
            pieces.append(RowPiece(name, name, 0, rows))
            continue
        bounds = [rows * i // count for i in range(count + 1)]
        pieces += [RowPiece(f"{name}[{a}:{b}]", name, a, b) for a, b in itertools.pairwise(bounds)]
    return pieces


def shard_parameters(sizes: Mapping[str, int], num_shards: int) -> tuple[tuple[str, ...], ...]:
    """Pack named tensors (name -> bytes, in model order) into at most `num_shards` non-empty shards.

    Raises:
        ValueError: no tensors, or `num_shards` < 1.
    """
    if not sizes:
        raise ValueError("the model has no parameters")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    order = {name: i for i, name in enumerate(sizes)}
    count = min(num_shards, len(sizes))
    loads = [0] * count
    members: list[list[str]] = [[] for _ in range(count)]
    # largest first; equal sizes in model order (a stable, platform-independent tie-break)
    for name in sorted(sizes, key=lambda n: (-sizes[n], order[n])):
        target = min(range(count), key=lambda i: (loads[i], i))
        loads[target] += sizes[name]
        members[target].append(name)
    return tuple(tuple(sorted(names, key=order.__getitem__)) for names in members)


def _weight(key: str, peer_id: str) -> bytes:
    return hashlib.sha256(f"{key}\x00{peer_id}".encode()).digest()


def owner_of(key: str, candidates: Collection[str]) -> str:
    """The rendezvous-hashing owner of `key` among `candidates`.

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError(f"no live candidate to own {key!r}")
    return max(candidates, key=lambda peer_id: (_weight(key, peer_id), peer_id))


def deal_owners(key: str, shard_bytes: Sequence[int], candidates: Sequence[str]) -> tuple[str, ...]:
    """The owner of every shard: largest first, each to the candidate with the fewest bytes so far.

    Ties (equal sizes, equal loads) are broken by shard index and by the rendezvous weight of
    (`key`, candidate), so two jobs on one swarm deal their shards to different peers first.

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError(f"no candidate to own the shards of {key!r}")
    rank = {peer: i for i, peer in enumerate(sorted(set(candidates), key=lambda p: (_weight(key, p), p)))}
    loads = dict.fromkeys(rank, 0)
    owners = [""] * len(shard_bytes)
    for index in sorted(range(len(shard_bytes)), key=lambda i: (-shard_bytes[i], i)):
        owner = min(loads, key=lambda peer: (loads[peer], rank[peer]))
        loads[owner] += shard_bytes[index]
        owners[index] = owner
    return tuple(owners)


@dataclasses.dataclass(frozen=True)
class SyncLayout:
    """Who owns which parameters, given the job's workers (see module docstring).

    Attributes:
        job_id: salts the owner hash (two jobs on one swarm spread their owners differently).
        workers: the N + b workers; a worker's index is its data slot.
        shards: parameter names of each shard.
        candidates: the workers that may own shards (None: all); all dead: every live worker may.
        shard_bytes: each shard's size for the deal (None: equal sizes).
    """

    job_id: str
    workers: tuple[str, ...]
    shards: tuple[tuple[str, ...], ...]
    candidates: tuple[str, ...] | None = None
    shard_bytes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.workers or len(set(self.workers)) != len(self.workers):
            raise ValueError("workers must be non-empty and distinct")
        names = [name for shard in self.shards for name in shard]
        if not self.shards or any(not shard for shard in self.shards) or len(set(names)) != len(names):
            raise ValueError("shards must be non-empty and disjoint")
        if self.candidates is not None and (
            not self.candidates or not set(self.candidates) <= set(self.workers)
        ):
            raise ValueError("owner candidates must be a non-empty subset of the workers")
        if self.shard_bytes is not None and len(self.shard_bytes) != len(self.shards):
            raise ValueError("shard_bytes must give one size per shard")

    @classmethod
    def build(
        cls,
        job_id: str,
        workers: Sequence[str],
        sizes: Mapping[str, int],
        num_shards: int | None = None,
        candidates: Sequence[str] | None = None,
    ) -> SyncLayout:
        """The layout of a job: `num_shards` (None: one per worker) shards of the named tensors."""
        owners = candidates if candidates is not None else workers
        shards = shard_parameters(sizes, num_shards or len(owners))
        shard_bytes = tuple(sum(sizes[name] for name in shard) for shard in shards)
        return cls(
            job_id,
            tuple(workers),
            shards,
            tuple(candidates) if candidates is not None else None,
            shard_bytes,
        )

    @functools.cached_property
    def dealt(self) -> tuple[str, ...]:
        """The owner of every shard while every candidate lives (`deal_owners`)."""
        sizes = self.shard_bytes if self.shard_bytes is not None else (1,) * len(self.shards)
        return deal_owners(self.job_id, sizes, self.candidates or self.workers)

    def live(self, dead: Collection[str]) -> list[str]:
        return [w for w in self.workers if w not in dead]

    def owners(self, dead: Collection[str] = ()) -> tuple[str, ...]:
        """The owner of every shard once the `dead` workers are gone.

        Raises:
            ValueError: every worker is dead.
        """
        live = self.live(dead)
        eligible = [w for w in live if w in self.candidates] if self.candidates is not None else live
        pool = eligible or live
        if not pool:
            raise ValueError(f"no live candidate to own the shards of {self.job_id!r}")
        kept = set(pool)
        return tuple(
            dealt if dealt in kept else owner_of(f"{self.job_id}/{index}", pool)
            for index, dealt in enumerate(self.dealt)
        )

    def shards_of(self, peer_id: str, dead: Collection[str] = ()) -> list[int]:
        """Indices of the shards `peer_id` owns with the `dead` workers gone."""
        return [index for index, owner in enumerate(self.owners(dead)) if owner == peer_id]

    def index_of(self, peer_id: str) -> int:
        return self.workers.index(peer_id)


def batch_slot(step: int, worker_index: int, num_workers: int, batches_per_epoch: int) -> tuple[int, int]:
    """(data epoch, batch index in it) that worker `worker_index` trains at `step`.

    Raises:
        ValueError: out-of-range arguments.
    """
    if step < 0 or not 0 <= worker_index < num_workers or batches_per_epoch < 1:
        raise ValueError("need step >= 0, 0 <= worker_index < num_workers and batches_per_epoch >= 1")
    slot = step * num_workers + worker_index
    return divmod(slot, batches_per_epoch)
