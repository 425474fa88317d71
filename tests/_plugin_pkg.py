"""A throwaway researcher's package for plugin tests: a module plus a dist-info with entry_points.txt.

Put the returned folder on ``sys.path`` (in-process) or ``PYTHONPATH`` (subprocess peers) and
``importlib.metadata`` finds its entry points, exactly as it would for an installed wheel.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path

# A model ("demo_mlp": two linear layers on 6 features, 3 classes) and a data set ("demo_blobs": three
# seeded Gaussian blobs), the way a researcher would write them against the public API.
DEMO_MODULE = """
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from ravnest_p2p.models import ModelSpec, TensorSpec
from ravnest_p2p.training.data import ArrayDataset
from ravnest_p2p.training.datasets import DatasetSpec


class DemoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    hidden: int = Field(default=32, ge=1)


def build(config):
    return [nn.Sequential(nn.Linear(6, config.hidden), nn.ReLU()), nn.Linear(config.hidden, 3)]


MODEL = ModelSpec(
    key="demo_mlp",
    config_cls=DemoConfig,
    build=build,
    input_spec=lambda c: TensorSpec((6,), torch.float32),
    label_spec=lambda c: TensorSpec((), torch.int64, high=3),
    loss=lambda c: "cross_entropy",
)


class BlobsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    num_samples: int = Field(default=600, ge=10)


def load_blobs(config, *, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, config.num_samples)
    centres = 3.0 * rng.standard_normal((3, 6))
    x = (centres[labels] + rng.standard_normal((config.num_samples, 6))).astype(np.float32)
    data = ArrayDataset(torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64)))
    cut = int(0.8 * config.num_samples)
    return (
        ArrayDataset(data.inputs[:cut], data.labels[:cut]),
        ArrayDataset(data.inputs[cut:], data.labels[cut:]),
    )


def make_blobs():
    return DatasetSpec(name="demo_blobs", config_cls=BlobsConfig, load=load_blobs)
"""

DEMO_ENTRY_POINTS = {
    "ravnest_p2p.models": {"demo_mlp": "ravnest_demo_plugin:MODEL"},
    "ravnest_p2p.datasets": {"demo_blobs": "ravnest_demo_plugin:make_blobs"},
}


def write_plugin_package(
    root: Path,
    *,
    module: str = "ravnest_demo_plugin",
    source: str = DEMO_MODULE,
    entry_points: Mapping[str, Mapping[str, str]] = DEMO_ENTRY_POINTS,
    dist_name: str = "ravnest-demo-plugin",
) -> Path:
    """Write ``module`` and a ``dist_name`` dist-info declaring `entry_points` under `root`; return it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    dist_info = root / f"{dist_name.replace('-', '_')}-0.1.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
    lines = []
    for group, entries in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
        lines.append("")
    (dist_info / "entry_points.txt").write_text("\n".join(lines))
    return root
