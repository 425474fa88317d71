"""What this peer tells the swarm about its plugins: the names of the plugin models and data sets it serves.

Only plugin names go in the record (built-ins go without saying for a given software version), sorted,
at most `MAX_PLUGINS` of each kind: a volunteer with more installed advertises the first ones by name and
is, for the rest, planned only once it read the job (`JobSupervisor.unfit` is then None).
"""

from __future__ import annotations

import logging

from ravnest_p2p.discovery.records import MAX_PLUGINS
from ravnest_p2p.models.plugins import plugin_models
from ravnest_p2p.models.registry import BUILTIN_MODELS
from ravnest_p2p.training.datasets import plugin_datasets

__all__ = ["advertised_plugins"]

logger = logging.getLogger(__name__)


def advertised_plugins() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(plugin model names, plugin data-set names) for this peer's record."""
    models = sorted(plugin_models(builtins=BUILTIN_MODELS))
    datasets = sorted(plugin_datasets())
    for kind, names in (("models", models), ("data sets", datasets)):
        if len(names) > MAX_PLUGINS:
            logger.warning(
                "%d plugin %s installed; the record lists the first %d", len(names), kind, MAX_PLUGINS
            )
        if names:
            logger.info("serving plugin %s: %s", kind, ", ".join(names[:MAX_PLUGINS]))
    return tuple(models[:MAX_PLUGINS]), tuple(datasets[:MAX_PLUGINS])
