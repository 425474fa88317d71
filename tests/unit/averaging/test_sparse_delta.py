"""SparseLoCo-style top-k (chunked, 2-4 bit values), its error feedback, and momentum kept locally.

That error feedback loses nothing is checked with the other codecs' in `test_pseudograd`.

Asserts use torch.allclose: the first torch.testing.assert_close imports for seconds on a busy host.
"""

import pytest
import torch

from ravnest_p2p.averaging import DeltaCompression, OuterOptimizer, OuterOptimizerConfig
from ravnest_p2p.averaging.pseudograd import compress, encoded_bytes

TOPK = DeltaCompression.TOPK


def test_chunked_topk_keeps_its_share_of_every_chunk():
    value = torch.tensor([9.0, 1, 2, 3, 0.1, 0.2, -0.4, 0.3])  # chunk 1 has the 4 largest overall
    decoded, nbytes = compress(value, TOPK, topk_fraction=0.5, topk_chunk=4)
    assert torch.equal(decoded, torch.tensor([9.0, 0, 0, 3, 0, 0, -0.4, 0.3]))
    # 2 chunks x (2 entries x (2-bit index + 32-bit value)) = 2 x ceil(68 / 8)
    assert nbytes == 2 * 9 == encoded_bytes(8, TOPK, topk_fraction=0.5, topk_chunk=4)


def test_two_bit_values_are_sign_and_the_chunks_smallest_or_largest_kept_magnitude():
    value = torch.tensor([5.0, -1.0, 0.0, 2.0, -4.0, 0.5, 0.0, 0.0])
    decoded, _ = compress(value, TOPK, topk_fraction=0.5, topk_chunk=8, topk_bits=2)
    # kept: 5, -4, 2, -1 (magnitudes 1..5); 2 bit: sign + {1, 5}; 2 rounds down to 1, -4 up to -5
    assert torch.equal(decoded, torch.tensor([5.0, -1.0, 0, 1.0, -5.0, 0, 0, 0]))
    decoded4, _ = compress(value, TOPK, topk_fraction=0.5, topk_chunk=8, topk_bits=4)
    assert torch.allclose(decoded4, torch.tensor([5.0, -1.0, 0, 1 + 4 / 7 * 2, -(1 + 4 / 7 * 5), 0, 0, 0]))
    # 4096-element chunks, 3 %: 123 entries x (12-bit index + 2 bits) + two fp32 per chunk
    assert encoded_bytes(8192, TOPK, topk_fraction=0.03, topk_chunk=4096, topk_bits=2) == 2 * (8 + 216)
    # at 25 % a bitmap of the chunk is cheaper than 12-bit indices
    assert encoded_bytes(4096, TOPK, topk_fraction=0.25, topk_chunk=4096, topk_bits=2) == 8 + 512 + 256
    with pytest.raises(ValueError, match="topk_bits"):
        compress(value, TOPK, topk_bits=1)


def test_residual_decay_scales_what_is_carried():
    config = OuterOptimizerConfig(
        lr=1.0, momentum=0.0, compression=TOPK, topk_fraction=0.25, residual_decay=0.5
    )
    outer = OuterOptimizer(config)
    outer.initialise({"w": torch.zeros(4)})
    outer.step(outer.outgoing({"w": -torch.tensor([4.0, 2.0, 1.0, 0.5])}))  # sends 4; residual 0, 2, 1, .5
    assert torch.equal(outer.residual["w"], torch.tensor([0.0, 2.0, 1.0, 0.5]))
    theta = outer.theta["w"].clone()
    proposal = outer.outgoing({"w": theta})["w"]  # Δ = 0: sends the largest of 0.5 x residual
    assert torch.equal(theta - proposal, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_local_momentum_uncompressed_is_the_outer_momentum_step():
    # 3 replicas, mean of proposals: the replicas' own buffers give the same anchors as a shared one
    gen = torch.Generator().manual_seed(4)
    start = torch.randn(16, generator=gen)
    shared = [OuterOptimizer(OuterOptimizerConfig(lr=0.7, momentum=0.9)) for _ in range(3)]
    local = [
        OuterOptimizer(OuterOptimizerConfig(lr=0.7, momentum=0.9, local_momentum=True)) for _ in range(3)
    ]
    for o in shared + local:
        o.initialise({"w": start})
    for _ in range(5):
        drifts = [0.1 * torch.randn(16, generator=gen) for _ in range(3)]
        for group in (shared, local):
            proposals = [o.outgoing({"w": o.theta["w"] - d})["w"] for o, d in zip(group, drifts, strict=True)]
            mean = torch.stack(proposals).mean(0)
            for o in group:
                o.step({"w": mean})
    assert torch.equal(local[0].theta["w"], local[2].theta["w"])
    assert torch.allclose(local[0].theta["w"], shared[0].theta["w"], atol=1e-5, rtol=1e-5)


def test_a_failed_sync_leaves_the_local_momentum_as_it_was():
    outer = OuterOptimizer(OuterOptimizerConfig(compression=TOPK, topk_fraction=0.5, local_momentum=True))
    outer.initialise({"w": torch.zeros(4)})
    outer.step(outer.outgoing({"w": torch.ones(4)}))
    before = outer.momentum["w"].clone()
    outer.outgoing({"w": outer.theta["w"] + 3})  # this ring never averaged
    outer.step({})
    assert torch.equal(outer.momentum["w"], before)


def test_unsent_entries_stay_in_the_replicas_weights_not_resent():
    # each replica continues from anchor - residual, so what it did not send is neither lost nor
    # counted again: sent over all syncs + final residual = the progress its training made
    config = OuterOptimizerConfig(
        lr=1.0, momentum=0.0, compression=TOPK, topk_fraction=0.1, topk_chunk=16, unsent_stays_local=True
    )
    replicas = [OuterOptimizer(config) for _ in range(2)]
    for o in replicas:
        o.initialise({"w": torch.zeros(64)})
    weights = [torch.zeros(64), torch.zeros(64)]
    gen = torch.Generator().manual_seed(5)
    progress, sent = [torch.zeros(64), torch.zeros(64)], [torch.zeros(64), torch.zeros(64)]
    for _ in range(5):
        for i in range(len(replicas)):
            step = torch.randn(64, generator=gen)
            weights[i] = weights[i] - step
            progress[i] += step
        proposals = [o.outgoing({"w": w})["w"] for o, w in zip(replicas, weights, strict=True)]
        for i, o in enumerate(replicas):
            sent[i] += o.theta["w"] - proposals[i]
        mean = torch.stack(proposals).mean(0)
        weights = [o.step({"w": mean})["w"] for o in replicas]
        assert torch.equal(replicas[0].theta["w"], replicas[1].theta["w"])
        for o, w in zip(replicas, weights, strict=True):
            assert torch.allclose(w, o.theta["w"] - o.residual["w"])
    for i, o in enumerate(replicas):
        assert torch.allclose(sent[i] + o.residual["w"], progress[i], atol=1e-5, rtol=0)
