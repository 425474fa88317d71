"""Models from other installed packages, through the ``ravnest_p2p.models`` entry-point group.

The protocol (docs/your-model-and-data.md). A researcher's distribution declares, in its
``pyproject.toml``::

    [project.entry-points."ravnest_p2p.models"]
    my_lm = "my_pkg.models:MY_LM"

and ``my_pkg.models.MY_LM`` is a `ModelSpec` whose ``key`` is ``my_lm`` (or a callable with no arguments
returning one). A volunteer who installs the package serves the model: jobs name it by key and config
exactly like a built-in one, and the peer's record lists it (`discovery.records.PeerRecord.plugin_models`)
so planners leave out the peers that lack it.

Why entry points and not a path to code in the job: a job is untrusted network data. A peer only ever runs
code its owner installed; the job names it.

Validation. Each entry point is loaded and checked once per process (`reload_plugins` starts over). A
plugin that fails to import, raises, returns the wrong type, has a bad or clashing name, or a config class
that does not forbid unknown fields is skipped with a warning naming it (`plugin_problems` lists them):
a broken plugin never breaks the peer, it only means the peer does not serve that model. Two distributions
registering the same name are both skipped (which one a peer got would otherwise depend on its sys.path).
A name equal to a built-in model is refused: built-ins always win.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
import re
import threading
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

from ravnest_p2p.models.spec import LOSSES, TensorSpec

__all__ = [
    "MODELS_GROUP",
    "PLUGIN_NAME_RE",
    "InvalidPlugin",
    "PluginProblem",
    "check_config_cls",
    "load_entry_points",
    "plugin_model_problems",
    "plugin_models",
    "reload_plugins",
    "validate_model_spec",
]

logger = logging.getLogger(__name__)

MODELS_GROUP = "ravnest_p2p.models"
# what a plugin name may be: short (the peer's signed record lists them) and plain
PLUGIN_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,47}$")

T = TypeVar("T")


class InvalidPlugin(ValueError):
    """An entry point gave something this package cannot use; the message names the plugin."""


@dataclasses.dataclass(frozen=True)
class PluginProblem:
    """A plugin that was skipped, and why (for logs and `status`)."""

    group: str
    name: str
    source: str  # "distribution version (module:attr)"
    reason: str

    def describe(self) -> str:
        return f"plugin {self.name!r} from {self.source}: {self.reason}"


def _source(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = entry_point.dist
    who = f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"
    return f"{who} ({entry_point.value})"


def load_entry_points(
    group: str, validate: Callable[[str, Any], T]
) -> tuple[dict[str, T], list[PluginProblem]]:
    """Load and validate every entry point of `group`; never raises for a bad plugin.

    Args:
        group: the entry-point group.
        validate: turns (entry point name, loaded object) into the value kept, or raises (any exception:
            the plugin is skipped and the exception's message is the reason).

    Returns:
        (valid values by name, problems), both sorted by name.
    """
    importlib.invalidate_caches()  # a package installed (or a path added) since the last load
    by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for entry_point in importlib.metadata.entry_points(group=group):
        by_name.setdefault(entry_point.name, []).append(entry_point)
    values: dict[str, T] = {}
    problems: list[PluginProblem] = []
    for name in sorted(by_name):
        entries = by_name[name]
        if len({e.value for e in entries}) > 1:
            sources = ", ".join(sorted(_source(e) for e in entries))
            problems.append(PluginProblem(group, name, sources, "registered by more than one distribution"))
            continue
        entry_point = entries[0]
        try:
            values[name] = validate(name, entry_point.load())
        except Exception as exc:  # a broken plugin must not break the peer: skip it, say why
            problems.append(PluginProblem(group, name, _source(entry_point), f"{type(exc).__name__}: {exc}"))
    for problem in problems:
        logger.warning("skipping %s", problem.describe())
    return values, problems


def _check_name(kind: str, name: str, declared: str, builtins: Collection[str]) -> None:
    if not PLUGIN_NAME_RE.match(name):
        raise InvalidPlugin(f"{kind} name {name!r} must match {PLUGIN_NAME_RE.pattern}")
    if declared != name:
        raise InvalidPlugin(f"the entry point is named {name!r} but the {kind} calls itself {declared!r}")
    if name in builtins:
        raise InvalidPlugin(f"{name!r} is a built-in {kind}; pick another name")


def check_config_cls(kind: str, config_cls: Any) -> None:
    """A plugin's config class: a pydantic model that refuses unknown fields (typos must not pass)."""
    if not (isinstance(config_cls, type) and issubclass(config_cls, BaseModel)):
        raise InvalidPlugin(f"the {kind}'s config_cls must be a pydantic BaseModel subclass")
    if config_cls.model_config.get("extra") != "forbid":
        raise InvalidPlugin(f"the {kind}'s config_cls must forbid unknown fields (extra='forbid')")


def validate_model_spec(name: str, obj: Any, *, builtins: Collection[str] = ()) -> Any:
    """Check what a ``ravnest_p2p.models`` entry point gave; return the `ModelSpec`.

    Raises:
        InvalidPlugin: the reason, in words a plugin author can act on.
    """
    from ravnest_p2p.models.registry import ModelSpec  # the registry imports this module lazily

    if callable(obj) and not isinstance(obj, ModelSpec):
        obj = obj()
    if not isinstance(obj, ModelSpec):
        raise InvalidPlugin(f"expected a ModelSpec (or a callable returning one), got {type(obj).__name__}")
    _check_name("model", name, obj.key, builtins)
    check_config_cls("model", obj.config_cls)
    for field in ("build", "input_spec", "label_spec", "loss"):
        if not callable(getattr(obj, field)):
            raise InvalidPlugin(f"ModelSpec.{field} must be callable")
    try:
        defaults = obj.config_cls()
    except Exception:
        return obj  # no default config: the parts are checked when a job gives one
    for field in ("input_spec", "label_spec"):
        if not isinstance(getattr(obj, field)(defaults), TensorSpec):
            raise InvalidPlugin(f"ModelSpec.{field}(config) must return a TensorSpec")
    if obj.loss(defaults) not in LOSSES:
        raise InvalidPlugin(f"ModelSpec.loss(config) must be one of {sorted(LOSSES)}")
    return obj


@dataclasses.dataclass
class _Loaded:
    values: Mapping[str, Any]
    problems: list[PluginProblem]


_lock = threading.Lock()  # the compute thread and the event loop may both ask first
_models: _Loaded | None = None


def plugin_models(builtins: Collection[str] = ()) -> Mapping[str, Any]:
    """Valid plugin `ModelSpec`s by key (loaded on first use; see module docstring)."""
    global _models
    with _lock:
        if _models is None:
            values, problems = load_entry_points(
                MODELS_GROUP, lambda name, obj: validate_model_spec(name, obj, builtins=builtins)
            )
            _models = _Loaded(values, problems)
        return _models.values


def plugin_model_problems() -> list[PluginProblem]:
    """Model plugins that were skipped, and why (empty until `plugin_models` ran)."""
    return list(_models.problems) if _models is not None else []


def reload_plugins() -> None:
    """Forget the loaded model plugins: the next lookup scans the entry points again."""
    global _models
    with _lock:
        _models = None
