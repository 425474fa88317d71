"""The README as written: its Python compiles and imports only the public API, its commands exist.

`tests/e2e/test_readme_runs.py` (slow) runs the training script itself.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import tomllib

import ravnest_p2p
from tests.readme_snippets import README, code_blocks, script_snippets


def test_every_python_snippet_compiles() -> None:
    snippets = code_blocks("python")
    assert snippets
    for code in snippets:
        compile(code, str(README), "exec")


def test_python_snippets_import_only_the_public_api() -> None:
    for code in code_blocks("python"):
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ravnest_p2p"):
                assert node.module == "ravnest_p2p", f"deep import in the README: {node.module}"
                assert {alias.name for alias in node.names} <= set(ravnest_p2p.__all__)


def test_the_training_snippet_is_a_script() -> None:
    (script,) = script_snippets()
    assert "asyncio.run(" in script
    assert "await" not in script.split('if __name__ == "__main__":')[1]  # no top-level await
    # the swarm it starts has as many peers as it waits for: LocalSwarm(n) is a bootstrap + n
    started = int(re.search(r"LocalSwarm\((\d+)", script).group(1)) + 1
    waited = int(re.search(r"wait_for_peers\((\d+)", script).group(1))
    assert started == waited


def test_commands_name_real_programs() -> None:
    scripts = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["scripts"]
    text = "\n".join(code_blocks("bash"))
    for name in re.findall(r"\.venv/bin/(ravnest-[a-z-]+)", text):
        assert name in scripts, name
    for module in re.findall(r"python -m (ravnest_p2p[\w.]*)", README.read_text()):
        assert importlib.util.find_spec(module) is not None, module
