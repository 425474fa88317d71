"""Several cluster replicas in one process, synced by plain averaging or by the outer optimizer.

The rings are simulated by plain means of what each replica's `OuterOptimizer.outgoing` proposes (the
in-process path: compression applied in process, one rounding per replica). The real rings now carry
the encoded Δ and re-quantise at each hop (`averaging/deltawire.py`); `outer_wire.py` trains with that
wire in the loop. The outer syncs run the real `OuterOptimizer` of every replica (its own anchor,
momentum and residuals), as the stage owners would.

Bytes are per replica (what one cluster's owners upload per sync), for a ring over C clusters:
- wire (fp32 ring): 2(C-1)/C x 4 bytes per element;
- would be: a ring moving the encoded Δ (int8/int4: 2(C-1)/C x encoded bytes, re-quantising sums at
  each hop as INTELLECT-1 does, which the rings now do: measured within 0.3 %, `bench_outer_wire.py`);
  top-k as an all-gather: (C-1) x encoded (the ring's exact sparse sums cost up to ~1.5x that).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from ravnest_p2p.averaging import DeltaCompression, OuterOptimizer, OuterOptimizerConfig
from ravnest_p2p.training.data import load_char_corpus, load_digits
from ravnest_p2p.transport.codec import Compression, decode_tensor, encode_tensor

__all__ = ["Method", "Problem", "Trace", "make_problem", "simulate"]

CONTEXT = 8


@dataclass(frozen=True)
class Method:
    """How replicas sync: every `period` inner steps, plainly (`outer` None) or by the outer optimizer.

    `fp16`: a plain average through the ring's fp16 compression (what plain averaging can do today).
    `plain_codec`: a plain average through one of the ring's 8-bit codecs instead (``uniform8bit``,
    ``quantile8bit``: hivemind's, `transport/codec.py`), each of the C ring chunks quantised on its own.
    """

    name: str
    period: int
    outer: OuterOptimizerConfig | None = None
    fp16: bool = False
    plain_codec: str = ""


@dataclass
class Problem:
    model: nn.Module
    train_x: Tensor
    train_y: Tensor
    val_x: Tensor
    val_y: Tensor
    batch_size: int
    inner_lr: float


@dataclass
class Trace:
    """Validation loss at sync points, with cumulative bytes per replica and tokens (samples) seen."""

    steps: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)
    would_be_bytes: list[int] = field(default_factory=list)
    bytes_per_sync: int = 0
    would_be_per_sync: int = 0


def _char_problem(batch_size: int, hidden: int) -> Problem:
    corpus = load_char_corpus()

    def windows(ids: Tensor, limit: int | None) -> tuple[Tensor, Tensor]:
        idx = torch.arange(len(ids) - CONTEXT)
        if limit is not None:  # an evenly spaced subset of the validation text
            idx = idx[:: max(1, len(idx) // limit)][:limit]
        return ids[idx[:, None] + torch.arange(CONTEXT)], ids[idx + CONTEXT]

    train_x, train_y = windows(corpus.train_ids, None)
    val_x, val_y = windows(corpus.val_ids, 4096)
    vocab = corpus.vocab_size
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(vocab, 16),
        nn.Flatten(),
        nn.Linear(16 * CONTEXT, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, vocab),
    )
    return Problem(model, train_x, train_y, val_x, val_y, batch_size, inner_lr=2e-3)


def _digits_problem(batch_size: int, hidden: int) -> Problem:
    train, val = load_digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    return Problem(model, train.inputs, train.labels, val.inputs, val.labels, batch_size, inner_lr=1e-3)


def make_problem(kind: Literal["char", "digits"], *, batch_size: int = 64, hidden: int = 256) -> Problem:
    return _char_problem(batch_size, hidden) if kind == "char" else _digits_problem(batch_size, hidden)


def _val_loss(model: nn.Module, problem: Problem) -> float:
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(problem.val_x), problem.val_y))


def _ring_bytes(numel: int, method: Method, num_replicas: int) -> tuple[int, int]:
    """(bytes on the wire today, bytes a compressed transport would move) per replica per sync."""
    share = 2 * (num_replicas - 1) / num_replicas
    wire = math.ceil(share * (2 if method.fp16 else 4) * numel)
    if method.plain_codec:  # every member sends 2(C-1) encoded chunks of ~numel / C (codebooks included)
        chunks = torch.zeros(numel).chunk(num_replicas)
        encoded = sum(len(encode_tensor(c, Compression(method.plain_codec))) for c in chunks)
        return math.ceil(share * encoded), math.ceil(share * encoded)
    c = method.outer
    if c is None or c.compression is DeltaCompression.NONE:
        return wire, wire
    from ravnest_p2p.averaging.pseudograd import encoded_bytes

    encoded = encoded_bytes(
        numel,
        c.compression,
        chunk_numel=c.chunk_numel,
        topk_fraction=c.topk_fraction,
        topk_chunk=c.topk_chunk,
        topk_bits=c.topk_bits,
    )
    if c.compression is DeltaCompression.TOPK:
        return wire, (num_replicas - 1) * encoded
    return wire, math.ceil(share * encoded)


def simulate(
    problem: Problem, method: Method, *, num_replicas: int, num_steps: int, seed: int = 0, eval_every: int = 0
) -> Trace:
    """Train `num_replicas` replicas for `num_steps` inner steps each; evaluate after syncs.

    Evaluation happens at the first sync at or after every `eval_every` steps (0: the period), on
    replica 0 (after a sync all replicas hold the same values; with `unsent_stays_local` they differ by
    their residuals: then on their mean, what the closing plain average gives), and always at the end
    after a last sync.
    """
    models = [copy.deepcopy(problem.model) for _ in range(num_replicas)]
    inner = [torch.optim.Adam(m.parameters(), lr=problem.inner_lr) for m in models]
    gens = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(num_replicas)]
    outers = []
    if method.outer is not None:
        for m in models:
            outer = OuterOptimizer(method.outer)
            outer.initialise(dict(m.named_parameters()))
            outers.append(outer)
    numel = sum(p.numel() for p in problem.model.parameters())
    per_sync, would_be = _ring_bytes(numel, method, num_replicas)
    trace = Trace(bytes_per_sync=per_sync, would_be_per_sync=would_be)
    eval_every = eval_every or method.period
    syncs, next_eval = 0, eval_every
    for step in range(1, num_steps + 1):
        for model, opt, gen in zip(models, inner, gens, strict=True):
            idx = torch.randint(len(problem.train_x), (problem.batch_size,), generator=gen)
            loss = nn.functional.cross_entropy(model(problem.train_x[idx]), problem.train_y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if step % method.period and step != num_steps:
            continue
        _sync(models, outers, fp16=method.fp16, codec=method.plain_codec)
        syncs += 1
        if step >= next_eval or step == num_steps:
            next_eval = (step // eval_every + 1) * eval_every
            trace.steps.append(step)
            trace.samples.append(step * problem.batch_size * num_replicas)
            trace.val_loss.append(_val_loss(_consensus(models), problem))
            trace.wire_bytes.append(syncs * per_sync)
            trace.would_be_bytes.append(syncs * would_be)
    return trace


@torch.no_grad()
def _consensus(models: list[nn.Module]) -> nn.Module:
    """Replica 0, or the replicas' mean when they differ (`unsent_stays_local`): the closing average."""
    named = [dict(m.named_parameters()) for m in models]
    if all(torch.equal(named[0][n], p[n]) for p in named[1:] for n in named[0]):
        return models[0]
    mean = copy.deepcopy(models[0])
    for name, param in mean.named_parameters():
        param.copy_(torch.stack([p[name] for p in named]).mean(0))
    return mean


@torch.no_grad()
def _sync(
    models: list[nn.Module], outers: list[OuterOptimizer], *, fp16: bool = False, codec: str = ""
) -> None:
    named = [dict(m.named_parameters()) for m in models]
    if outers:
        proposals = [
            o.outgoing({n: t.detach().clone() for n, t in p.items()})
            for o, p in zip(outers, named, strict=True)
        ]
        mean = {n: torch.stack([p[n] for p in proposals]).mean(0) for n in proposals[0]}
        for outer, params in zip(outers, named, strict=True):
            for name, value in outer.step(mean).items():
                params[name].copy_(value)
    elif codec:  # each member's chunks and the mean's chunks through the ring's 8-bit codec
        names = list(named[0])
        flat = [torch.cat([p[n].detach().reshape(-1) for n in names]) for p in named]
        rounded = [_through(f, codec, len(models)) for f in flat]
        joint = _through(torch.stack(rounded).mean(0), codec, len(models))
        for params in named:
            offset = 0
            for name in names:
                n = params[name].numel()
                params[name].copy_(joint[offset : offset + n].reshape(params[name].shape))
                offset += n
    elif fp16:  # each member's values and the result rounded to fp16 (the ring re-rounds partial sums)
        half = [{n: t.detach().half().float() for n, t in p.items()} for p in named]
        mean = {n: torch.stack([p[n] for p in half]).mean(0).half().float() for n in half[0]}
        for params in named:
            for name, value in mean.items():
                params[name].copy_(value)
    else:
        mean = {n: torch.stack([p[n].detach() for p in named]).mean(0) for n in named[0]}
        for params in named:
            for name, value in mean.items():
                params[name].copy_(value)


def _through(flat: Tensor, codec: str, num_chunks: int) -> Tensor:
    """`flat` encoded and decoded by the ring's codec, one ring chunk at a time (a ring's parts)."""
    comp = Compression(codec)
    return torch.cat([decode_tensor(encode_tensor(c.contiguous(), comp)) for c in flat.chunk(num_chunks)])
