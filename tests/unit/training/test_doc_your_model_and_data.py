"""docs/your-model-and-data.md's Python examples run as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from ravnest_p2p.models.plugins import validate_model_spec
from ravnest_p2p.models.registry import BUILTIN_MODELS
from ravnest_p2p.training.data import ArrayDataset
from tests.readme_snippets import code_blocks

DOC = Path(__file__).resolve().parents[3] / "docs" / "your-model-and-data.md"
BLOCKS = code_blocks("python", DOC)


def test_the_doc_has_its_examples() -> None:
    assert len(BLOCKS) == 4


def test_the_plugin_example_passes_validation() -> None:
    namespace: dict[str, object] = {"__name__": "my_research.plugin"}
    exec(compile(BLOCKS[0], "plugin example", "exec"), namespace)
    spec = validate_model_spec("two_layer", namespace["TWO_LAYER"], builtins=BUILTIN_MODELS)
    layers = spec.build(spec.config_cls())
    assert len(layers) == 2
    blobs = namespace["BLOBS"]
    train, held_out = blobs.load(blobs.config_cls(), seed=0)  # type: ignore[attr-defined]
    assert isinstance(train, ArrayDataset)
    assert (len(train), len(held_out)) == (480, 120)
    exec(compile(BLOCKS[1], "job example", "exec"), {})


@pytest.mark.parametrize(
    "index",
    [2, pytest.param(3, marks=pytest.mark.slow)],  # 3 imports `datasets`: seconds on a busy host
)
def test_the_local_data_examples_run(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    if index == 3:
        pytest.importorskip("datasets")
    exec(compile(BLOCKS[index], f"example {index}", "exec"), {"__name__": "__main__"})
    assert "windows" in capsys.readouterr().out
