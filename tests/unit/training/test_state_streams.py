"""A stage's held state is served in pages from the live tensors or from disk: never a second copy.

Measured with the kernel's resident high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
after `limit_heap_retention`, so a freed page buffer leaves the process at once and the high-water
mark is the most the process ever held at one time. tracemalloc cannot see torch's allocations.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from ravnest_p2p.measurement.memory import limit_heap_retention, memory_snapshot
from ravnest_p2p.training.checkpoint import CheckpointFileSource, write_checkpoint
from ravnest_p2p.training.handover import HandoverServer, StaticSource, fetch_state
from ravnest_p2p.training.handover_wire import FetchStateRequest, ReadItem
from ravnest_p2p.training.stage_hook import snapshot_on_disk
from ravnest_p2p.training.stage_state import StageState, capture_state, live_tensors, tensor_digest
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint
from ravnest_p2p.utils.aio import wait_until

from .stage_state_helpers import build_split, resnet_job, train_step

_PAGE_BYTES = 2 << 20
_SLACK_BYTES = 4 << 20  # interpreter and list bookkeeping, page tables
_HWM_RESET = Path("/proc/self/clear_refs")


def _hwm_reset_works() -> bool:
    try:
        _HWM_RESET.write_text("5")
    except OSError:
        return False
    return memory_snapshot().hwm > 0


pytestmark = pytest.mark.skipif(not _hwm_reset_works(), reason="needs Linux /proc/self/clear_refs")


def _state(total_bytes: int = 48 << 20) -> StageState:
    tensors = {
        "0.weight": torch.randn(total_bytes // 4 // 2),  # one tensor of many pages
        "1.weight": torch.randn(total_bytes // 4 // 4),
        **{f"2.{i}.bias": torch.randn(total_bytes // 4 // 4 // 8) for i in range(8)},
    }
    return StageState(tensors=tensors, digests={n: tensor_digest(t) for n, t in tensors.items()})


def _pages(state: StageState) -> list[list[ReadItem]]:
    """Every element of every tensor, in pages of at most `_PAGE_BYTES` (one tensor range per page)."""
    pages = []
    for name, tensor in state.tensors.items():
        per_page = _PAGE_BYTES // tensor.element_size()
        for start in range(0, tensor.numel(), per_page):
            count = min(per_page, tensor.numel() - start)
            pages.append([ReadItem(name=name, start=start, count=count)])
    return pages


def _peak_extra_bytes(serve: object, state: StageState) -> int:
    """Serve the manifest and every page of `state` from `serve` (a published source); the peak growth."""
    network = FakeNetwork()
    server = HandoverServer(RpcEndpoint(network.create("owner"), "run"), max_page_bytes=_PAGE_BYTES)
    server.publish("big", serve, epoch=0, allowed={"new"})  # type: ignore[arg-type]
    _epoch, published = server._find(FetchStateRequest(job_id="big", epoch=0), "new")
    gc.collect()
    _HWM_RESET.write_text("5")
    baseline = memory_snapshot().rss
    listing = server._manifest(published, FetchStateRequest(job_id="big", layers=(0, 3)))
    assert {e.name: e.digest for e in listing[0]} == state.digests
    for items in _pages(state):
        _version, tensors = server._read(published, items)
        item = items[0]
        expected = state.tensors[item.name].reshape(-1)[item.start : item.start + item.count]
        assert torch.equal(tensors[0], expected)
        del tensors
    return memory_snapshot().hwm - baseline


@pytest.fixture(scope="module", autouse=True)
def _heap_follows_tensors() -> None:
    assert limit_heap_retention()


def test_a_held_state_takes_the_live_tensors_over():
    (stage,) = build_split(resnet_job(), [(0, 5)])
    train_step([stage], seed=1)  # optimizer state exists
    live = live_tensors(stage)
    held = capture_state(stage, copy=False)
    assert set(held.tensors) == set(live)
    for name, tensor in held.tensors.items():
        assert tensor.data_ptr() == live[name].data_ptr(), name


def test_serving_a_held_state_needs_a_page_not_a_copy():
    state = _state()
    extra = _peak_extra_bytes(StaticSource(state), state)
    print(f"state {state.nbytes / 2**20:.0f} MiB: peak extra {extra / 2**20:.1f} MiB while serving it")
    assert extra <= 2 * _PAGE_BYTES + _SLACK_BYTES


def test_serving_a_checkpoint_reads_pages_from_disk(tmp_path):
    state = _state()
    gc.collect()
    _HWM_RESET.write_text("5")
    baseline = memory_snapshot().rss
    path = write_checkpoint(
        tmp_path, state.tensors, job=resnet_job(), step=1, first_layer=0, end_layer=3, digests=state.digests
    )
    written = memory_snapshot().hwm - baseline
    print(f"state {state.nbytes / 2**20:.0f} MiB: peak extra {written / 2**20:.1f} MiB while writing it")
    assert written <= 2 * _PAGE_BYTES + _SLACK_BYTES
    extra = _peak_extra_bytes(CheckpointFileSource(path), state)
    print(f"peak extra {extra / 2**20:.1f} MiB while serving it from disk")
    assert extra <= 2 * _PAGE_BYTES + _SLACK_BYTES


async def test_an_in_place_move_serves_the_old_epoch_from_a_snapshot_on_disk():
    job = resnet_job()
    (stage,) = build_split(job, [(0, 5)])
    train_step([stage], seed=1)
    at_switch = {n: t.clone() for n, t in live_tensors(stage).items()}
    source = snapshot_on_disk(stage, job, epoch=2, progress={"micro_batches": 1})
    directory = source.manifest_path.parent
    train_step([stage], seed=2)  # the stage trains on; the snapshot does not move
    network = FakeNetwork()
    server = HandoverServer.of(RpcEndpoint(network.create("owner"), "run"))
    await server.start()
    server.publish(job.job_id, source, epoch=2, allowed={"new"})
    got = await fetch_state(
        RpcEndpoint(network.create("new"), "run"), "owner", job.job_id, layers=(0, 5), epoch=2
    )
    assert set(got.tensors) == set(at_switch)
    for name, tensor in got.tensors.items():
        assert torch.equal(tensor, at_switch[name]), name
    assert got.meta is not None
    assert got.meta.num_steps == 1
    await server.aclose()
    del source, got
    server._sources.clear()

    def removed() -> bool:  # a server task may still hold the source for a moment on a busy host
        gc.collect()
        return not directory.exists()

    await wait_until(removed, 10, message="the snapshot removed with its source")  # lives as long as it
