"""Tampered checkpoint files (data or manifest) are refused by `load_checkpoint`; no stage changes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from ravnest_p2p.training.checkpoint import CheckpointError, load_checkpoint, read_manifest, write_checkpoint
from ravnest_p2p.training.stage_state import capture_state, restore_state
from tests.unit.training.stage_state_helpers import build_split, resnet_job, train_step, union_state


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_manifest(path: Path, edit) -> None:
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _consistent_rewrite(path: Path) -> None:
    """An attacker who can write both files: new data, and a manifest rewritten to match it."""
    data_path = path.with_suffix(".safetensors")
    manifest = json.loads(path.read_text())
    name = "1.conv1.weight"
    job = resnet_job()
    [stage] = build_split(job, [(0, 5)])
    tensors = dict(capture_state(stage).tensors)
    tensors[name] = torch.full_like(tensors[name], 7.0)
    forged = write_checkpoint(
        path.parent / "forged", tensors, job=job, step=manifest["step"], first_layer=0, end_layer=5
    )
    data_path.write_bytes(forged.with_suffix(".safetensors").read_bytes())
    path.write_bytes(forged.read_bytes())


def _tamper(kind: str, path: Path) -> None:
    data_path = path.with_suffix(".safetensors")
    header_len = struct.unpack("<Q", data_path.read_bytes()[:8])[0]
    if kind == "flipped_data_byte":
        _flip(data_path, data_path.stat().st_size - 3)
    elif kind == "truncated_data":
        data_path.write_bytes(data_path.read_bytes()[:-10])
    elif kind == "appended_data":
        data_path.write_bytes(data_path.read_bytes() + b"\x00" * 8)
    elif kind == "huge_header_length":
        data = bytearray(data_path.read_bytes())
        data[:8] = struct.pack("<Q", 1 << 62)
        data_path.write_bytes(bytes(data))
    elif kind == "header_not_json":
        _flip(data_path, 8 + header_len // 2)
    elif kind == "manifest_digest":
        _edit_manifest(path, lambda m: m["tensors"]["1.conv1.weight"].update(digest="0" * 16))
    elif kind == "manifest_shape":
        _edit_manifest(path, lambda m: m["tensors"]["1.conv1.weight"].update(shape=[36]))
    elif kind == "manifest_path_traversal":
        _edit_manifest(path, lambda m: m.update(file="../../secret.safetensors"))
    elif kind == "manifest_garbage":
        path.write_bytes(b"\x80\x04pickle?")
    elif kind == "manifest_huge":
        path.write_bytes(b" " * (33 << 20))
    elif kind == "consistent_rewrite":
        _consistent_rewrite(path)
    elif kind == "missing_data":
        data_path.unlink()


_KINDS = [
    "flipped_data_byte",
    "truncated_data",
    "appended_data",
    "huge_header_length",
    "header_not_json",
    "manifest_digest",
    "manifest_shape",
    "manifest_path_traversal",
    "manifest_garbage",
    "manifest_huge",
    "consistent_rewrite",
    "missing_data",
]


def test_tampered_checkpoints_are_refused_and_change_nothing(tmp_path, hostile):
    hostile.surface = "file:checkpoint"
    job = resnet_job()
    [source] = build_split(job, [(0, 5)])
    train_step([source], 0)
    state = capture_state(source)
    [target] = build_split(job, [(0, 5)])
    before = union_state([target])
    cases = [(kind, True) for kind in _KINDS] + [(k, False) for k in _KINDS if k != "consistent_rewrite"]
    for kind, announced in cases:
        # without the announced digest, the file checks alone must catch all but a consistent rewrite
        directory = tmp_path / f"{kind}-{announced}"
        path = write_checkpoint(
            directory, state.tensors, job=job, step=1, first_layer=0, end_layer=5, meta=state.meta
        )
        digest = read_manifest(path).digest() if announced else None
        load_checkpoint(path, job=job, manifest_digest=digest)  # intact: accepted
        _tamper(kind, path)
        hostile.sent += 1
        try:
            _, loaded = load_checkpoint(path, job=job, manifest_digest=digest)
        except CheckpointError:
            hostile.refused += 1
            continue
        hostile.forged_accepted += 1
        restore_state(target, loaded)
        pytest.fail(f"tampering {kind!r} was accepted")
    after = union_state([target])
    hostile.state_changes = sum(not torch.equal(before[n], after[n]) for n in before)
    assert hostile.refused == len(cases)
    assert hostile.state_changes == 0
