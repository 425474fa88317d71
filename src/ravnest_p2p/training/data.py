"""Data sets that ship with installed packages (no downloads) and a deterministic sharded batcher.

Why deterministic sharding: clusters are data-parallel replicas, so each must see its own shard of
every epoch, and every peer of a cluster (and a peer that replaces another) must derive the same
order from the same numbers. The order is a pure function of ``(seed, epoch)`` (numpy's
``SeedSequence`` mixes them), and shard ``i`` of ``k`` takes every ``k``-th index of that
permutation: shards of one epoch are disjoint and together cover the data set.

Sources: scikit-learn's bundled 8x8 digits (UCI optical digits test set, 1797 images); CPython's
``pydoc_data.topics`` (the help text of the language reference, ~465k characters).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Literal

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "ArrayDataset",
    "CharCorpus",
    "iterate_batches",
    "load_char_corpus",
    "load_digits",
    "make_classification",
    "make_regression",
    "num_batches",
    "shard_indices",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ArrayDataset:
    """Inputs and labels held in memory; sample ``i`` is ``(inputs[i], labels[i])``."""

    inputs: Tensor
    labels: Tensor

    def __post_init__(self) -> None:
        if self.inputs.shape[0] != self.labels.shape[0]:
            raise ValueError(f"{self.inputs.shape[0]} inputs but {self.labels.shape[0]} labels")

    def __len__(self) -> int:
        return int(self.inputs.shape[0])


def _split_permutation(num_samples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(np.random.SeedSequence([seed, 0xD161])).permutation(num_samples)


def load_digits(*, test_fraction: float = 0.2, seed: int = 0) -> tuple[ArrayDataset, ArrayDataset]:
    """scikit-learn's 8x8 digits as ``(train, test)``: inputs ``(N, 1, 8, 8)`` float32, labels int64.

    Pixels (0..16) are standardised with the train split's mean and std. The split is a seeded
    permutation, identical on every peer.

    Raises:
        ValueError: ``test_fraction`` outside (0, 1).
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    from sklearn.datasets import load_digits as _sk_load_digits  # ships the data; no download

    bunch = _sk_load_digits()
    images = np.asarray(bunch.images, dtype=np.float32)
    targets = np.asarray(bunch.target, dtype=np.int64)
    order = _split_permutation(len(targets), seed)
    num_test = round(len(targets) * test_fraction)
    test_idx, train_idx = order[:num_test], order[num_test:]
    mean, std = float(images[train_idx].mean()), float(images[train_idx].std())
    x = torch.from_numpy((images - mean) / std).unsqueeze(1)
    y = torch.from_numpy(targets)
    train_t, test_t = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
    return ArrayDataset(x[train_t], y[train_t]), ArrayDataset(x[test_t], y[test_t])


@dataclasses.dataclass(frozen=True)
class CharCorpus:
    """A character-level corpus: sorted vocabulary and contiguous train/validation token ids."""

    vocab: str
    train_ids: Tensor
    val_ids: Tensor

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.vocab)

    def encode(self, text: str) -> Tensor:
        """Token ids (int64) of ``text``.

        Raises:
            ValueError: a character is not in the vocabulary.
        """
        index = {c: i for i, c in enumerate(self.vocab)}
        try:
            return torch.tensor([index[c] for c in text], dtype=torch.int64)
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Tensor) -> str:
        """Text of a 1-D tensor of token ids."""
        return "".join(self.vocab[i] for i in ids.tolist())

    def windows(self, split: Literal["train", "val"], block_size: int) -> ArrayDataset:
        """Non-overlapping windows: inputs ``(N, block_size)``, labels the same shifted by one.

        Raises:
            ValueError: ``block_size < 1`` or longer than the split.
        """
        ids = self.train_ids if split == "train" else self.val_ids
        if block_size < 1 or block_size + 1 > len(ids):
            raise ValueError(f"block_size must lie in [1, {len(ids) - 1}], got {block_size}")
        num_windows = (len(ids) - 1) // block_size
        span = num_windows * block_size
        inputs = ids[:span].view(num_windows, block_size)
        labels = ids[1 : span + 1].view(num_windows, block_size)
        return ArrayDataset(inputs.clone(), labels.clone())


def load_char_corpus(*, val_fraction: float = 0.1) -> CharCorpus:
    """CPython's ``pydoc_data.topics`` as a character corpus (topics joined in sorted key order).

    The last ``val_fraction`` of the text is the validation split (contiguous, so no window leaks).

    Raises:
        ValueError: ``val_fraction`` outside (0, 1).
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    from pydoc_data.topics import topics

    text = "".join(topics[key] for key in sorted(topics))
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    num_val = round(len(ids) * val_fraction)
    return CharCorpus(vocab=vocab, train_ids=ids[:-num_val].clone(), val_ids=ids[-num_val:].clone())


def make_regression(
    *, num_samples: int, in_features: int, out_features: int = 1, noise_std: float = 0.1, seed: int = 0
) -> ArrayDataset:
    """``y = x @ W + b + noise`` with a seeded random linear teacher; float32 inputs and targets."""
    if num_samples < 1 or in_features < 1 or out_features < 1 or noise_std < 0:
        raise ValueError("num_samples, in_features, out_features must be >= 1 and noise_std >= 0")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_samples, in_features)).astype(np.float32)
    w = rng.standard_normal((in_features, out_features)).astype(np.float32) / np.sqrt(in_features)
    b = rng.standard_normal(out_features).astype(np.float32)
    y = x @ w + b + noise_std * rng.standard_normal((num_samples, out_features)).astype(np.float32)
    return ArrayDataset(torch.from_numpy(x), torch.from_numpy(y.astype(np.float32)))


def make_classification(
    *, num_samples: int, in_features: int, num_classes: int, class_sep: float = 2.0, seed: int = 0
) -> ArrayDataset:
    """Gaussian blobs around seeded class centres (``class_sep`` apart on average); int64 labels."""
    if num_samples < 1 or in_features < 1 or num_classes < 2 or class_sep <= 0:
        raise ValueError("need num_samples, in_features >= 1, num_classes >= 2 and class_sep > 0")
    rng = np.random.default_rng(seed)
    centres = class_sep * rng.standard_normal((num_classes, in_features)) / np.sqrt(2.0)
    labels = rng.integers(0, num_classes, num_samples)
    x = centres[labels] + rng.standard_normal((num_samples, in_features))
    return ArrayDataset(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(labels.astype(np.int64)))


def shard_indices(
    num_samples: int,
    *,
    seed: int,
    epoch: int,
    shard_index: int = 0,
    num_shards: int = 1,
    shuffle: bool = True,
) -> Tensor:
    """Sample indices of one shard for one epoch (see module docstring).

    Raises:
        ValueError: bad shard index/count or negative sizes.
    """
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"need 0 <= shard_index < num_shards, got {shard_index} of {num_shards}")
    if num_samples < 0 or seed < 0 or epoch < 0:
        raise ValueError("num_samples, seed and epoch must be non-negative")
    if shuffle:
        order = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(num_samples)
    else:
        order = np.arange(num_samples)
    return torch.from_numpy(order[shard_index::num_shards].astype(np.int64))


def num_batches(num_samples: int, *, batch_size: int, num_shards: int = 1, drop_last: bool = False) -> int:
    """Batches `iterate_batches` yields for the smallest shard (every shard yields at least this)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    smallest = num_samples // num_shards
    return smallest // batch_size if drop_last else -(-smallest // batch_size)


def iterate_batches(
    dataset: ArrayDataset,
    *,
    batch_size: int,
    seed: int,
    epoch: int,
    shard_index: int = 0,
    num_shards: int = 1,
    shuffle: bool = True,
    drop_last: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(inputs, labels)`` batches of one shard of one epoch, deterministically.

    Raises:
        ValueError: ``batch_size < 1`` or bad shard arguments.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    indices = shard_indices(
        len(dataset), seed=seed, epoch=epoch, shard_index=shard_index, num_shards=num_shards, shuffle=shuffle
    )
    for start in range(0, len(indices), batch_size):
        batch = indices[start : start + batch_size]
        if drop_last and len(batch) < batch_size:
            return
        yield dataset.inputs[batch], dataset.labels[batch]
