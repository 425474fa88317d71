"""Training modes other than the pipeline + replica averaging: IST and synchronous SGD with backup workers.

Why this package. Pipelines with replica averaging (`runtime/`, `averaging/`) ship activations every
micro-batch and whole replicas every round. Two other seeds of the project trade differently:

- Independent Subnetwork Training (`ist`, `ist_local`; Yuan et al., arXiv 1910.02120): each worker owns a
  disjoint random slice of a wide MLP's hidden units per round and ships ~1/n of the hidden layers per
  round, not the full model per step. Its limit, shown exactly on quadratics by `ist_theory` (Shulgin &
  Richtárik, arXiv 2306.16484): with heterogeneous data it converges to a biased point that step-size
  decay does not remove.
- Synchronous SGD with backup workers (`backup_workers`; Chen et al., arXiv 1604.00981): N + b workers,
  the first N gradients of a step are averaged, the b stragglers' are dropped; nothing stale is applied.
  The asynchronous apply-on-arrival baseline sits next to it.

Rejected here: a generic "strategy" plugin interface before either mode runs over the network (two
implementations are too few to know its shape).

What is here is network-free. Backup workers run over real peers through `training.sync_runner`
(`mode: sync_backup` in the JobSpec), with the pure layout in `sync_layout`; IST through
`training.ist_runner` (`mode: ist`), with the pure block/holder bookkeeping in `ist_blocks`. See
docs/training-modes.md.
"""

from ravnest_p2p.strategies.backup_workers import (
    AsyncShardOwner,
    GradientRejected,
    StepUpdate,
    Submission,
    SyncAggregator,
    SyncBackupOwner,
    Verdict,
)
from ravnest_p2p.strategies.ist import (
    IstDeal,
    IstTraffic,
    ScaleRule,
    deal_hidden_units,
    extract_subnetwork,
    hidden_sizes,
    ist_bytes_per_worker,
    subnetwork_bytes,
    write_back,
)
from ravnest_p2p.strategies.ist_local import eval_layers, recalibrate_batchnorm, train_ist_round

__all__ = [
    "AsyncShardOwner",
    "GradientRejected",
    "IstDeal",
    "IstTraffic",
    "ScaleRule",
    "StepUpdate",
    "Submission",
    "SyncAggregator",
    "SyncBackupOwner",
    "Verdict",
    "deal_hidden_units",
    "eval_layers",
    "extract_subnetwork",
    "hidden_sizes",
    "ist_bytes_per_worker",
    "recalibrate_batchnorm",
    "subnetwork_bytes",
    "train_ist_round",
    "write_back",
]
