"""The README's code blocks, for the tests that check it runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

_BLOCK_RE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def code_blocks(language: str, path: Path = README) -> list[str]:
    """Every fenced block in `path` tagged `language`, in order."""
    return [body for lang, body in _BLOCK_RE.findall(path.read_text()) if lang == language]


def script_snippets() -> list[str]:
    """The Python blocks that run as scripts (they have a ``__main__`` guard)."""
    return [code for code in code_blocks("python") if 'if __name__ == "__main__":' in code]
