"""Tokenisers a data spec names: text in, int64 token ids out, the same on every peer.

``byte``: the UTF-8 bytes (vocabulary 256; nothing to agree on). ``char``: one id per distinct character,
ids in sorted character order over the data's own text unless the spec gives the vocabulary (then a
character outside it is an error, never silently dropped). ``hf_json``: a Hugging Face ``tokenizers``
``tokenizer.json`` file read locally (needs the optional ``tokenizers`` package; ``pip install
ravnest_p2p[data]``); its ``sha256`` may be pinned so a peer with another file refuses.

Whatever the tokeniser, the data set's content digest (`training.datasets`) covers the token ids, so a
peer whose tokenisation differs (another ``tokenizers`` version, another file) refuses the job.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

__all__ = ["ByteTokenizer", "CharTokenizer", "HFTokenizer", "TokenizerSpec", "encode", "vocab_size"]


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ByteTokenizer(_Spec):
    """UTF-8 bytes; vocabulary 256."""

    kind: Literal["byte"] = "byte"


class CharTokenizer(_Spec):
    """One id per character; ``vocab`` (sorted on use) fixes the ids, else the data's characters do."""

    kind: Literal["char"] = "char"
    vocab: str | None = Field(default=None, min_length=1, max_length=1_000_000)


class HFTokenizer(_Spec):
    """A ``tokenizers`` ``tokenizer.json`` on this peer's disk (no hub access)."""

    kind: Literal["hf_json"] = "hf_json"
    path: Path
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


TokenizerSpec = Annotated[ByteTokenizer | CharTokenizer | HFTokenizer, Field(discriminator="kind")]


def _char_vocab(spec: CharTokenizer, text: str) -> str:
    return "".join(sorted(set(spec.vocab if spec.vocab is not None else text)))


def encode(spec: ByteTokenizer | CharTokenizer | HFTokenizer, text: str) -> tuple[Tensor, int]:
    """(token ids as a 1-D int64 tensor, vocabulary size) of `text`.

    Raises:
        ValueError: a character outside a given vocabulary; a missing or mismatching tokenizer file;
            ``tokenizers`` not installed for ``hf_json``.
    """
    if isinstance(spec, ByteTokenizer):
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        return torch.from_numpy(ids), 256
    if isinstance(spec, CharTokenizer):
        vocab = _char_vocab(spec, text)
        index = {c: i for i, c in enumerate(vocab)}
        missing = set(text) - index.keys()
        if missing:
            raise ValueError(f"characters {sorted(missing)[:5]!r} are not in the char tokenizer's vocab")
        return torch.tensor([index[c] for c in text], dtype=torch.int64), len(vocab)
    return _encode_hf(spec, text)


def _encode_hf(spec: HFTokenizer, text: str) -> tuple[Tensor, int]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(
            "tokenizer kind 'hf_json' needs the 'tokenizers' package on this peer (pip install tokenizers)"
        ) from None
    if not spec.path.is_file():
        raise ValueError(f"tokenizer file {spec.path} does not exist on this peer")
    raw = spec.path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if spec.sha256 is not None and digest != spec.sha256:
        raise ValueError(f"tokenizer file {spec.path} has sha256 {digest}, the job pins {spec.sha256}")
    tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return torch.tensor(ids, dtype=torch.int64), int(tokenizer.get_vocab_size(with_added_tokens=True))


def vocab_size(spec: ByteTokenizer | CharTokenizer | HFTokenizer, text: str) -> int:
    """The vocabulary size `encode` would report for `text` (without encoding it, for byte and char)."""
    if isinstance(spec, ByteTokenizer):
        return 256
    if isinstance(spec, CharTokenizer):
        return len(_char_vocab(spec, text))
    return encode(spec, text)[1]
