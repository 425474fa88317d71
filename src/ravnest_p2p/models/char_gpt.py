"""A GPT-style character-level transformer (Radford et al. 2018/2019 layout, pre-LayerNorm).

Cuttable layers: token+position embedding, each transformer block, final LayerNorm + head. Every
cut therefore carries one ``(N, T, n_embd)`` tensor.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

__all__ = ["CharGPTConfig", "build_char_gpt"]


class CharGPTConfig(BaseModel):
    """Config of `char_gpt`: inputs ``(N, block_size)`` int64 token ids, logits ``(N, T, vocab)``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(default=128, ge=2)
    block_size: int = Field(default=64, ge=1)
    num_layers: int = Field(default=2, ge=1)
    num_heads: int = Field(default=2, ge=1)
    embed_dim: int = Field(default=64, ge=1)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> CharGPTConfig:
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})"
            )
        return self


class Embedding(nn.Module):
    """Token plus learned absolute position embeddings."""

    def __init__(self, config: CharGPTConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.embed_dim)
        self.position = nn.Embedding(config.block_size, config.embed_dim)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.dropout(self.token(idx) + self.position(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask, written with explicit matmuls."""

    mask: Tensor

    def __init__(self, config: CharGPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim)
        self.dropout = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        n, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        head_dim = c // self.num_heads
        q, k, v = (z.view(n, t, self.num_heads, head_dim).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        weights = self.dropout(torch.softmax(scores, dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(n, t, c)
        return self.dropout(self.proj(out))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: CharGPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.embed_dim)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(config.embed_dim, 4 * config.embed_dim),
            nn.GELU(),
            nn.Linear(4 * config.embed_dim, config.embed_dim),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def build_char_gpt(config: CharGPTConfig) -> list[nn.Module]:
    """Build ``[embedding, block * num_layers, LayerNorm+head]``."""
    head = nn.Sequential(nn.LayerNorm(config.embed_dim), nn.Linear(config.embed_dim, config.vocab_size))
    return [Embedding(config), *(Block(config) for _ in range(config.num_layers)), head]
