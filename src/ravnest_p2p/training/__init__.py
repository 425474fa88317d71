"""Training: built-in data sets and deterministic sharded batching."""

from ravnest_p2p.training.data import (
    ArrayDataset,
    CharCorpus,
    iterate_batches,
    load_char_corpus,
    load_digits,
    make_classification,
    make_regression,
    num_batches,
    shard_indices,
)

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
