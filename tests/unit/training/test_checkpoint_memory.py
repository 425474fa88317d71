"""Bounded memory: moving or writing a large stage state never needs a second full copy of it."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from ravnest_p2p.training.checkpoint import load_checkpoint, write_checkpoint
from ravnest_p2p.training.handover import HandoverServer, StaticSource, fetch_state
from ravnest_p2p.training.stage_state import StageState, tensor_digest
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint

from .stage_state_helpers import resnet_job

pytestmark = pytest.mark.slow

_STATE_BYTES = 256 << 20
_PAGE_BYTES = 8 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _big_state() -> StageState:
    tensors = {
        "0.weight": torch.randn(_STATE_BYTES // 8),  # one tensor larger than many pages
        "1.weight": torch.randn(_STATE_BYTES // 16),
        **{f"2.{i}.bias": torch.randn(1000) for i in range(200)},  # many small ones
    }
    return StageState(tensors=tensors, digests={n: tensor_digest(t) for n, t in tensors.items()})


async def test_a_large_transfer_holds_the_received_state_plus_pages_only():
    state = _big_state()
    total = state.nbytes
    network = FakeNetwork()
    owner = RpcEndpoint(network.create("owner"), "run")
    server = HandoverServer.of(owner)
    await server.start()
    server.publish("big", StaticSource(state), epoch=0, allowed={"new"})
    client = RpcEndpoint(network.create("new"), "run")
    gc.collect()
    baseline = peak = _rss_bytes()
    original_call = client.call

    async def sampling_call(*args, **kwargs):
        nonlocal peak
        reply = await original_call(*args, **kwargs)
        peak = max(peak, _rss_bytes())
        return reply

    client.call = sampling_call  # type: ignore[method-assign]
    got = await fetch_state(client, "owner", "big", layers=(0, 3), page_bytes=_PAGE_BYTES, timeout_s=300)
    peak = max(peak, _rss_bytes())
    assert got.digests == state.digests
    growth = peak - baseline
    print(f"state {total / 2**20:.0f} MiB, peak growth {growth / 2**20:.0f} MiB")
    # one received copy, plus page buffers: ~9 pages of 8 MiB whatever the state's size (measured at 192
    # and 384 MiB; glibc keeps freed 8 MiB blocks on its heap), ~10 MiB with 1 MiB pages
    assert growth < total + 12 * _PAGE_BYTES


def test_writing_and_reading_a_large_checkpoint_streams(tmp_path):
    state = _big_state()
    job = resnet_job()
    gc.collect()
    baseline = _rss_bytes()
    path = write_checkpoint(
        tmp_path, state.tensors, job=job, step=1, first_layer=0, end_layer=3, digests=state.digests
    )
    written_growth = _rss_bytes() - baseline
    print(f"write: RSS growth {written_growth / 2**20:.0f} MiB for a {state.nbytes / 2**20:.0f} MiB state")
    assert written_growth < 64 << 20
    del state
    gc.collect()
    baseline = _rss_bytes()
    _, loaded = load_checkpoint(path)
    read_growth = _rss_bytes() - baseline
    assert read_growth < loaded.nbytes + (64 << 20)
