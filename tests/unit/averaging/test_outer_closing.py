"""The closing round under a Δ codec: coded where the anchors agree, plain where they may not; the
replicas always end bit-identical."""

import asyncio

import torch

from ravnest_p2p.averaging import DeltaCompression, OuterAverager, OuterOptimizerConfig, RingConfig
from tests.unit.averaging.test_outer import cluster_digests, make_swarm, run_rounds, train_a_little

CLOSING = 2**40
INT4 = OuterOptimizerConfig(compression=DeltaCompression.INT4, chunk_numel=64)


def _cluster_means(live, cluster_of):
    """Per name: the mean over clusters of its value (each cluster holds every name once)."""
    values: dict[str, list[torch.Tensor]] = {}
    for params in live.values():
        for name, value in params.items():
            values.setdefault(name, []).append(value.double())
    assert all(len(v) == len(set(cluster_of.values())) for v in values.values())
    return {name: torch.stack(v).mean(0) for name, v in values.items()}


async def _close(averagers):
    metrics = await asyncio.gather(*(a.run_round(CLOSING, wait_for_all=True) for a in averagers.values()))
    assert all(m is not None for m in metrics)
    return sum(m.bytes_sent for m in metrics if m is not None)


async def _closing_bytes_fp32() -> int:
    live, averagers, cluster_of = await make_swarm(4, OuterOptimizerConfig(), same_start=True)
    train_a_little(live, cluster_of, 99)
    return await _close(averagers)


async def test_a_coded_closing_round_ends_identical_near_the_plain_mean_for_a_fraction_of_the_bytes():
    live, averagers, cluster_of = await make_swarm(4, INT4, same_start=True)
    await run_rounds(live, averagers, cluster_of, 3)
    train_a_little(live, cluster_of, 99)
    plain_mean = _cluster_means(live, cluster_of)
    some = next(iter(averagers.values()))
    assert isinstance(some, OuterAverager)
    assert some.outer.residual
    sent = await _close(averagers)
    digests = cluster_digests(live, cluster_of)
    assert all(d == digests[0] for d in digests.values())
    for params in live.values():
        for name, value in params.items():
            # int4 per 64 values of Δ (a few 0.05-sized steps): within a few hundredths of the mean
            torch.testing.assert_close(value.double(), plain_mean[name], atol=0.06, rtol=0)
    assert sent < 0.3 * await _closing_bytes_fp32()


async def _close_plainly_and_check(live, averagers, cluster_of):
    """Train a little, close; every replica must end identical, at the plain mean of the replicas."""
    train_a_little(live, cluster_of, 99)
    plain_mean = _cluster_means(live, cluster_of)
    await _close(averagers)
    digests = cluster_digests(live, cluster_of)
    assert digests[0] == digests[1] == digests[2]
    for params in live.values():
        for name, value in params.items():
            torch.testing.assert_close(value.double(), plain_mean[name], atol=1e-6, rtol=0)


async def test_rings_whose_anchors_may_differ_close_plainly_and_end_identical():
    live, averagers, cluster_of = await make_swarm(3, INT4, same_start=True)
    await run_rounds(live, averagers, cluster_of, 2)
    for peer, averager in averagers.items():  # a sync every member saw without cluster 0
        assert isinstance(averager, OuterAverager)
        averager.outer.diverged.update(averager.outer.theta)
        if cluster_of[peer] == 0:
            for theta in averager.outer.theta.values():
                theta.add_(0.5)
    await _close_plainly_and_check(live, averagers, cluster_of)


async def test_members_that_disagree_on_a_rings_anchors_close_it_again_plainly():
    # cluster 0 missed a sync without its partners knowing: it closes plainly, they with int4; the
    # codecs differ, the rings refuse, and every member closes those rings again, plainly
    live, averagers, cluster_of = await make_swarm(3, INT4, same_start=True)
    await run_rounds(live, averagers, cluster_of, 2)
    for peer, averager in averagers.items():
        assert isinstance(averager, OuterAverager)
        if cluster_of[peer] == 0:
            averager.outer.diverged.update(averager.outer.theta)
            for theta in averager.outer.theta.values():
                theta.add_(0.5)
    await _close_plainly_and_check(live, averagers, cluster_of)
    for averager in averagers.values():
        assert isinstance(averager, OuterAverager)
        assert not averager.plain_close
        assert [m.round for m in averager.history] == [0, 1, CLOSING, CLOSING + 1]


async def test_a_sync_without_every_member_marks_its_rings_names_as_diverged():
    quick = RingConfig(step_timeout_s=2.0)
    left_out = INT4.model_copy(update={"wait_for_behind": False})  # else the sync waits for cluster 2
    live, averagers, cluster_of = await make_swarm(3, left_out, same_start=True, ring_config=quick)
    await run_rounds(live, averagers, cluster_of, 1)
    assert all(isinstance(a, OuterAverager) and not a.outer.diverged for a in averagers.values())
    train_a_little(live, cluster_of, 5)
    # cluster 2 does not come to sync 1: its partners average without it (after the step deadline)
    present = {p: a for p, a in averagers.items() if cluster_of[p] != 2}
    await asyncio.gather(*(a.run_round(1) for a in present.values()))
    for averager in present.values():
        assert isinstance(averager, OuterAverager)
        assert averager.outer.diverged == set(averager.outer.theta)
