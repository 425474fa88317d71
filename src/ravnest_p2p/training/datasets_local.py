"""Built-in local data sources: a text file or folder, NumPy arrays, a Hugging Face dataset saved to disk.

Paths are each peer's own (``~`` is expanded; relative paths are relative to the peer's working
directory): every volunteer puts the same data at the path the job names. That they really derived the
same samples is checked by the content digest the job pins (``sha256``, `training.datasets`).

Splits are deterministic. Text: the token stream's last ``val_fraction`` is held out (contiguous, so no
window straddles the split), then each part is cut into non-overlapping ``block_size`` windows whose
labels are the inputs shifted by one (next-token prediction). Arrays and feature columns: a permutation
seeded by ``split_seed`` picks the held-out samples (arrays are often sorted by class).

Saved `datasets` data sets are read with ``pyarrow`` alone (the Arrow IPC stream files ``save_to_disk``
writes, listed in its ``state.json``), so a peer needs neither ``datasets`` nor any hub access; ``pyarrow``
is optional (``pip install ravnest_p2p[data]``). NumPy files are read with ``allow_pickle=False``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from ravnest_p2p.training.data import ArrayDataset
from ravnest_p2p.training.tokenize import ByteTokenizer, CharTokenizer, TokenizerSpec, encode

__all__ = [
    "HFDiskConfig",
    "NumpyArraysConfig",
    "TextFilesConfig",
    "lm_windows",
    "load_hf_disk",
    "load_numpy_arrays",
    "load_text_files",
]

_SHA256 = r"^[0-9a-f]{64}$"


class _LocalConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    val_fraction: float = Field(default=0.1, gt=0, lt=1)
    sha256: str | None = Field(default=None, pattern=_SHA256, description="content digest every peer checks")


class TextFilesConfig(_LocalConfig):
    """A text file, or every file matching ``pattern`` under a folder (sorted by relative path, joined
    with a newline), tokenised and cut into next-token windows."""

    path: Path
    pattern: str = Field(default="*.txt", min_length=1, max_length=200)
    tokenizer: TokenizerSpec = ByteTokenizer()
    block_size: int = Field(default=64, ge=1, le=1 << 20)


class NumpyArraysConfig(_LocalConfig):
    """Inputs and labels: an ``.npz`` with arrays ``x`` and ``y`` (``path``), or two ``.npy`` files."""

    path: Path | None = None
    x_path: Path | None = None
    y_path: Path | None = None
    split_seed: int = Field(default=0, ge=0, le=2**31)

    @model_validator(mode="after")
    def _one_source(self) -> NumpyArraysConfig:
        if (self.path is None) == (self.x_path is None or self.y_path is None):
            raise ValueError("give either path (an .npz with x and y) or both x_path and y_path (.npy)")
        return self


class HFDiskConfig(_LocalConfig):
    """A data set saved with ``datasets``' ``save_to_disk``: a text column for language modelling, or
    input columns and a label column for supervised samples."""

    path: Path
    split: str = Field(default="train", min_length=1, max_length=64)
    val_split: str | None = Field(default=None, min_length=1, max_length=64)
    text_column: str | None = Field(default=None, min_length=1, max_length=128)
    input_columns: tuple[str, ...] = Field(default=(), max_length=1024)
    label_column: str | None = Field(default=None, min_length=1, max_length=128)
    tokenizer: TokenizerSpec = ByteTokenizer()
    block_size: int = Field(default=64, ge=1, le=1 << 20)
    split_seed: int = Field(default=0, ge=0, le=2**31)

    @model_validator(mode="after")
    def _one_kind(self) -> HFDiskConfig:
        if (self.text_column is None) == (not self.input_columns or self.label_column is None):
            raise ValueError("give either text_column, or input_columns and label_column")
        return self


def _local(path: Path) -> Path:
    return path.expanduser()


def lm_windows(ids: Tensor, block_size: int, *, what: str) -> ArrayDataset:
    """Non-overlapping windows of `ids`: inputs ``(N, block_size)``, labels the same shifted by one."""
    num_windows = (len(ids) - 1) // block_size
    if num_windows < 1:
        raise ValueError(f"{what} has {len(ids)} tokens: too few for one window of block_size {block_size}")
    span = num_windows * block_size
    inputs = ids[:span].view(num_windows, block_size).clone()
    labels = ids[1 : span + 1].view(num_windows, block_size).clone()
    return ArrayDataset(inputs, labels)


def _lm_splits(text: str, config: TextFilesConfig | HFDiskConfig, *, what: str) -> tuple[ArrayDataset, ...]:
    ids, _ = encode(config.tokenizer, text)
    num_val = max(1, round(len(ids) * config.val_fraction))
    return (
        lm_windows(ids[:-num_val], config.block_size, what=f"the training part of {what}"),
        lm_windows(ids[-num_val - 1 :], config.block_size, what=f"the held-out part of {what}"),
    )


def load_text_files(config: TextFilesConfig, *, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    """(train, held-out) next-token windows of the text (see module docstring)."""
    root = _local(config.path)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(
            (p for p in root.rglob(config.pattern) if p.is_file()),
            key=lambda p: p.relative_to(root).as_posix(),
        )
    else:
        raise ValueError(f"text data: {root} does not exist on this peer")
    if not files:
        raise ValueError(f"text data: no file matches {config.pattern!r} under {root}")
    try:
        text = "\n".join(p.read_text(encoding="utf-8") for p in files)
    except UnicodeDecodeError as exc:
        raise ValueError(f"text data under {root} is not UTF-8: {exc}") from None
    train, held_out = _lm_splits(text, config, what=f"{root}")
    return train, held_out


def _as_tensor(array: np.ndarray, what: str) -> Tensor:
    if array.dtype == object:
        raise ValueError(f"{what} holds Python objects; only numeric arrays are read")
    if np.issubdtype(array.dtype, np.floating):
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    if np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    raise ValueError(f"{what} has dtype {array.dtype}; expected numbers")


def _seeded_split(
    inputs: Tensor, labels: Tensor, val_fraction: float, split_seed: int
) -> tuple[ArrayDataset, ...]:
    num = int(inputs.shape[0])
    num_val = round(num * val_fraction)
    if num_val < 1 or num_val >= num:
        raise ValueError(f"{num} samples cannot be split with val_fraction {val_fraction}")
    order = torch.from_numpy(
        np.random.default_rng(np.random.SeedSequence([split_seed, 0x5A7A])).permutation(num)
    )
    val, train = order[:num_val], order[num_val:]
    return ArrayDataset(inputs[train], labels[train]), ArrayDataset(inputs[val], labels[val])


def load_numpy_arrays(config: NumpyArraysConfig, *, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    """(train, held-out) of the arrays (float arrays become float32, integer ones int64)."""
    try:
        if config.path is not None:
            with np.load(_local(config.path), allow_pickle=False) as archive:
                missing = {"x", "y"} - set(archive.files)
                if missing:
                    raise ValueError(
                        f"{config.path} lacks array(s) {sorted(missing)} (it has {archive.files})"
                    )
                x, y = archive["x"], archive["y"]
        else:
            assert config.x_path is not None  # the validator saw to it
            assert config.y_path is not None
            x = np.load(_local(config.x_path), allow_pickle=False)
            y = np.load(_local(config.y_path), allow_pickle=False)
    except FileNotFoundError as exc:
        raise ValueError(f"array data: {exc.filename} does not exist on this peer") from None
    inputs, labels = _as_tensor(x, "x"), _as_tensor(y, "y")
    if inputs.shape[0] != labels.shape[0]:
        raise ValueError(f"x has {inputs.shape[0]} samples but y has {labels.shape[0]}")
    train, held_out = _seeded_split(inputs, labels, config.val_fraction, config.split_seed)
    return train, held_out


def _read_arrow_split(directory: Path) -> Any:
    try:
        import pyarrow as pa
    except ImportError:
        raise ValueError(
            "reading a saved datasets data set needs 'pyarrow' on this peer (pip install ravnest_p2p[data])"
        ) from None
    state_path = directory / "state.json"
    if not state_path.is_file():
        raise ValueError(f"{directory} is not a data set saved with save_to_disk (no state.json)")
    state = json.loads(state_path.read_text())
    if state.get("_indices_data_files"):
        raise ValueError(f"{directory} was saved with an indices mapping; save it with flatten_indices()")
    tables = []
    for entry in state.get("_data_files", []):
        name = str(entry["filename"])
        if "/" in name or name.startswith("."):
            raise ValueError(f"{directory}/state.json names a file outside the folder: {name!r}")
        with pa.memory_map(str(directory / name)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    if not tables:
        raise ValueError(f"{directory} lists no data files")
    return pa.concat_tables(tables)


def _hf_split_dir(root: Path, split: str) -> Path:
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise ValueError(f"{root} has splits {splits}, not {split!r}")
        return root / split
    return root


def _column(table: Any, name: str, root: Path) -> np.ndarray:
    if name not in table.column_names:
        raise ValueError(f"{root} has columns {table.column_names}, not {name!r}")
    values = table.column(name).to_pylist()
    return np.asarray(values)


def _features(table: Any, config: HFDiskConfig, root: Path) -> tuple[Tensor, Tensor]:
    columns = [_column(table, name, root).reshape(table.num_rows, -1) for name in config.input_columns]
    assert config.label_column is not None  # the validator saw to it
    inputs = _as_tensor(np.concatenate(columns, axis=1), "the input columns")
    labels = _as_tensor(_column(table, config.label_column, root), config.label_column)
    return inputs, labels


def load_hf_disk(config: HFDiskConfig, *, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    """(train, held-out) of a saved `datasets` data set (see module docstring)."""
    root = _local(config.path)
    if not root.is_dir():
        raise ValueError(f"saved data set {root} does not exist on this peer")
    table = _read_arrow_split(_hf_split_dir(root, config.split))
    held_table = _read_arrow_split(_hf_split_dir(root, config.val_split)) if config.val_split else None
    if config.text_column is not None:
        text = "\n".join(str(v) for v in _column(table, config.text_column, root).tolist())
        if held_table is None:
            train, held_out = _lm_splits(text, config, what=str(root))
            return train, held_out
        held_text = "\n".join(str(v) for v in _column(held_table, config.text_column, root).tolist())
        tokenizer = config.tokenizer
        if isinstance(tokenizer, CharTokenizer) and tokenizer.vocab is None:
            tokenizer = CharTokenizer(vocab="".join(sorted(set(text + held_text))))  # one vocab, both splits
        return (
            lm_windows(encode(tokenizer, text)[0], config.block_size, what=f"split {config.split} of {root}"),
            lm_windows(
                encode(tokenizer, held_text)[0], config.block_size, what=f"split {config.val_split} of {root}"
            ),
        )
    inputs, labels = _features(table, config, root)
    if held_table is None:
        train, held_out = _seeded_split(inputs, labels, config.val_fraction, config.split_seed)
        return train, held_out
    held_inputs, held_labels = _features(held_table, config, root)
    return ArrayDataset(inputs, labels), ArrayDataset(held_inputs, held_labels)
