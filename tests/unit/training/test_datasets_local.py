"""Local data sources: text files, NumPy arrays, saved `datasets`; tokenisers; the pinned content digest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ravnest_p2p.training.datasets import (
    load_job_data,
    parse_dataset_config,
    pin_digest,
    reload_dataset_plugins,
)
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.tokenize import ByteTokenizer, CharTokenizer, HFTokenizer, encode

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def text_job(path: Path, **config: object) -> JobSpec:
    return JobSpec(dataset="text_files", dataset_config={"path": str(path), "block_size": 16, **config})


def test_a_text_file_becomes_next_token_windows(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(TEXT)
    train, held_out = load_job_data(text_job(tmp_path / "a.txt"))
    assert train.inputs.shape[1] == 16
    assert train.inputs.dtype == torch.int64
    assert torch.equal(train.inputs[0, 1:], train.labels[0, :-1])  # labels: the inputs shifted by one
    assert bytes(train.inputs[0].tolist()) == TEXT.encode()[:16]
    assert len(train) > 4 * len(held_out) > 0


def test_a_folder_is_read_in_path_order_whatever_the_listing(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text(TEXT[200:])
    (tmp_path / "1.txt").write_text(TEXT[:200])
    (tmp_path / "skip.md").write_text("not text data")
    folder = load_job_data(text_job(tmp_path, tokenizer={"kind": "char"}))
    (tmp_path / "all.txt").write_text(TEXT[:200] + "\n" + TEXT[200:])
    one = load_job_data(text_job(tmp_path / "all.txt", tokenizer={"kind": "char"}))
    assert torch.equal(folder[0].inputs, one[0].inputs)
    assert int(folder[0].inputs.max()) < len(set(TEXT + "\n"))


def test_tokenisers() -> None:
    ids, vocab = encode(ByteTokenizer(), "hé")
    assert (ids.tolist(), vocab) == ([104, 195, 169], 256)
    ids, vocab = encode(CharTokenizer(), "abca")
    assert (ids.tolist(), vocab) == ([0, 1, 2, 0], 3)
    ids, vocab = encode(CharTokenizer(vocab="dcba"), "abca")  # sorted: the order given does not matter
    assert (ids.tolist(), vocab) == ([0, 1, 2, 0], 4)
    with pytest.raises(ValueError, match="not in the char tokenizer's vocab"):
        encode(CharTokenizer(vocab="ab"), "abc")


def test_a_tokenizers_json_file(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "the": 1, "quick": 2, "fox": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    ids, size = encode(HFTokenizer(path=path), "the quick brown fox")
    assert (ids.tolist(), size) == ([1, 2, 0, 3], 4)
    with pytest.raises(ValueError, match="the job pins"):
        encode(HFTokenizer(path=path, sha256="0" * 64), "the")


def test_numpy_arrays_from_npz_and_npy(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((50, 4)), rng.integers(0, 3, 50)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    a = load_job_data(JobSpec(dataset="numpy_arrays", dataset_config={"path": str(tmp_path / "d.npz")}))
    b = load_job_data(
        JobSpec(
            dataset="numpy_arrays",
            dataset_config={"x_path": str(tmp_path / "x.npy"), "y_path": str(tmp_path / "y.npy")},
        )
    )
    assert (len(a[0]), len(a[1])) == (45, 5)
    assert a[0].inputs.dtype == torch.float32
    assert a[0].labels.dtype == torch.int64
    assert torch.equal(a[0].inputs, b[0].inputs)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}] * 50, dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"pickled|Object arrays"):  # never unpickled
        load_job_data(
            JobSpec(
                dataset="numpy_arrays",
                dataset_config={"x_path": str(tmp_path / "objects.npy"), "y_path": str(tmp_path / "y.npy")},
            )
        )


def _save_like_datasets(path: Path, splits: dict[str, dict[str, list[object]]]) -> Path:
    """The layout ``DatasetDict.save_to_disk`` writes (importing ``datasets`` takes seconds; the slow
    tests/integration/training/test_local_data_jobs.py uses the real thing)."""
    pa = pytest.importorskip("pyarrow")
    path.mkdir()
    (path / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for name, columns in splits.items():
        (path / name).mkdir()
        table = pa.table(columns)
        sink = pa.OSFile(str(path / name / "data-00000-of-00001.arrow"), "wb")
        with sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": name}
        (path / name / "state.json").write_text(json.dumps(state))
    return path


def _save_hf(tmp_path: Path) -> Path:
    train = {
        "text": [TEXT[i : i + 90] for i in range(0, 1500, 90)],
        "f": [[i, i + 1] for i in range(17)],
        "y": [i % 2 for i in range(17)],
    }
    test = {"text": [TEXT[:300]], "f": [[0, 1]], "y": [1]}
    return _save_like_datasets(tmp_path / "saved", {"train": train, "test": test})


def test_a_saved_datasets_data_set_is_read_without_the_library(tmp_path: Path) -> None:
    path = _save_hf(tmp_path)
    lm = load_job_data(
        JobSpec(
            dataset="hf_disk",
            dataset_config={"path": str(path), "text_column": "text", "block_size": 16, "val_split": "test"},
        )
    )
    assert lm[0].inputs.shape[1] == 16
    assert bytes(lm[1].inputs[0].tolist()) == TEXT.encode()[:16]
    features = load_job_data(
        JobSpec(
            dataset="hf_disk",
            dataset_config={
                "path": str(path),
                "input_columns": ["f"],
                "label_column": "y",
                "val_fraction": 0.2,
            },
        )
    )
    assert features[0].inputs.shape[1:] == (2,)
    assert len(features[0]) + len(features[1]) == 17
    with pytest.raises(ValueError, match="has splits"):
        load_job_data(
            JobSpec(
                dataset="hf_disk", dataset_config={"path": str(path), "split": "x", "text_column": "text"}
            )
        )


def test_the_pinned_digest_is_checked_on_every_peer(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(TEXT)
    pinned = pin_digest(text_job(tmp_path / "a.txt"))
    digest = pinned.dataset_config["sha256"]
    assert len(digest) == 64
    load_job_data(pinned)  # the same files: fine
    (tmp_path / "a.txt").write_text(TEXT.upper())  # another peer's copy differs
    reload_dataset_plugins()  # (and forget the data this process loaded)
    with pytest.raises(ValueError, match=r"this peer's data has digest .* the job pins "):
        load_job_data(pinned)


@pytest.mark.parametrize(
    ("name", "config", "match"),
    [
        ("text_files", {}, "path: Field required"),
        ("text_files", {"path": "x", "block_size": 0}, "block_size"),
        ("text_files", {"path": "x", "tokenizer": {"kind": "bpe"}}, "tokenizer"),
        ("text_files", {"path": "x", "sha256": "abc"}, "sha256"),
        ("numpy_arrays", {"x_path": "x.npy"}, "either path"),
        ("hf_disk", {"path": "x"}, "either text_column"),
        ("hf_disk", {"path": "x", "text_column": "t", "val_fraction": 1.0}, "val_fraction"),
    ],
)
def test_bad_local_configs_are_refused_naming_the_field(
    name: str, config: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        parse_dataset_config(name, config)


def test_missing_files_say_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist on this peer"):
        load_job_data(text_job(tmp_path / "nope.txt"))
    (tmp_path / "short.txt").write_text("abc")
    with pytest.raises(ValueError, match="too few for one window"):
        load_job_data(text_job(tmp_path / "short.txt"))
