from __future__ import annotations

import pytest
import torch

from ravnest_p2p.training import (
    ArrayDataset,
    iterate_batches,
    load_char_corpus,
    load_digits,
    make_classification,
    make_regression,
    num_batches,
    shard_indices,
)


def test_digits_split_is_deterministic_normalised_and_shaped():
    train, test = load_digits()
    again, _ = load_digits()
    assert len(train) + len(test) == 1797
    assert len(test) == round(1797 * 0.2)
    assert train.inputs.shape[1:] == (1, 8, 8)
    assert train.inputs.dtype == torch.float32
    assert train.labels.dtype == torch.int64
    assert set(train.labels.tolist()) == set(range(10))
    assert torch.equal(train.inputs, again.inputs)
    assert torch.equal(train.labels, again.labels)
    assert abs(float(train.inputs.mean())) < 1e-4
    assert float(train.inputs.std()) == pytest.approx(1.0, abs=1e-3)
    other, _ = load_digits(seed=1)
    assert not torch.equal(train.labels, other.labels)
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits(test_fraction=1.0)


def test_char_corpus_round_trips_and_windows_shift_by_one():
    corpus = load_char_corpus()
    assert corpus.vocab_size == len(set(corpus.vocab)) > 60
    assert corpus.vocab == "".join(sorted(corpus.vocab))
    text = "def f(x):\n    return x"
    assert corpus.decode(corpus.encode(text)) == text
    assert len(corpus.val_ids) == pytest.approx(0.1 * (len(corpus.train_ids) + len(corpus.val_ids)), abs=1)
    windows = corpus.windows("val", 32)
    assert windows.inputs.shape[1] == 32
    assert windows.inputs.dtype == torch.int64
    assert torch.equal(windows.inputs[:, 1:], windows.labels[:, :-1])
    assert torch.equal(windows.inputs[1, 0], windows.labels[0, -1])
    assert int(windows.inputs.max()) < corpus.vocab_size
    with pytest.raises(ValueError, match="vocabulary"):
        corpus.encode("\x00")
    with pytest.raises(ValueError, match="block_size"):
        corpus.windows("train", 0)


def test_synthetic_data_is_seeded():
    a = make_regression(num_samples=50, in_features=3, out_features=2, seed=4)
    b = make_regression(num_samples=50, in_features=3, out_features=2, seed=4)
    assert torch.equal(a.inputs, b.inputs)
    assert torch.equal(a.labels, b.labels)
    assert a.labels.shape == (50, 2)
    c = make_classification(num_samples=60, in_features=5, num_classes=3, seed=1)
    assert c.labels.dtype == torch.int64
    assert set(c.labels.tolist()) <= {0, 1, 2}
    with pytest.raises(ValueError):
        make_classification(num_samples=10, in_features=2, num_classes=1)
    with pytest.raises(ValueError, match="labels"):
        ArrayDataset(torch.zeros(3, 2), torch.zeros(2))


def test_batches_are_deterministic_and_epochs_differ():
    data = make_regression(num_samples=37, in_features=2)
    kwargs = {"batch_size": 5, "seed": 3, "shard_index": 1, "num_shards": 3}
    first = [y for _, y in iterate_batches(data, epoch=0, **kwargs)]
    again = [y for _, y in iterate_batches(data, epoch=0, **kwargs)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    other_epoch = torch.cat([y for _, y in iterate_batches(data, epoch=1, **kwargs)])
    assert not torch.equal(torch.cat(first), other_epoch)
    other_seed = shard_indices(37, seed=4, epoch=0, shard_index=1, num_shards=3)
    assert not torch.equal(other_seed, shard_indices(37, seed=3, epoch=0, shard_index=1, num_shards=3))


@pytest.mark.parametrize(("num_samples", "num_shards"), [(100, 1), (101, 3), (7, 7), (1797, 4)])
def test_shards_are_disjoint_and_cover_the_epoch(num_samples, num_shards):
    for epoch in range(2):
        shards = [
            shard_indices(num_samples, seed=9, epoch=epoch, shard_index=i, num_shards=num_shards)
            for i in range(num_shards)
        ]
        everything = torch.cat(shards)
        assert len(everything) == num_samples
        assert torch.equal(everything.sort().values, torch.arange(num_samples))
        assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1


def test_batch_counts_and_drop_last():
    data = make_regression(num_samples=23, in_features=2)
    sizes = [len(y) for _, y in iterate_batches(data, batch_size=5, seed=0, epoch=0)]
    assert sizes == [5, 5, 5, 5, 3]
    assert num_batches(23, batch_size=5) == 5
    dropped = [len(y) for _, y in iterate_batches(data, batch_size=5, seed=0, epoch=0, drop_last=True)]
    assert dropped == [5, 5, 5, 5]
    assert num_batches(23, batch_size=5, drop_last=True) == 4
    unshuffled = next(iterate_batches(data, batch_size=3, seed=0, epoch=0, shuffle=False))
    assert torch.equal(unshuffled[1], data.labels[:3])
    with pytest.raises(ValueError, match="shard_index"):
        shard_indices(10, seed=0, epoch=0, shard_index=2, num_shards=2)
    with pytest.raises(ValueError, match="batch_size"):
        next(iterate_batches(data, batch_size=0, seed=0, epoch=0))
