"""`causal_lm`: a decoder-only transformer family that scales from ~10M to ~1B parameters.

Two block styles, chosen by ``arch``:
  * ``gpt2`` (Radford et al. 2019): LayerNorm, GELU MLP of width 4d, learned absolute positions;
  * ``llama`` (Touvron et al. 2023): RMSNorm, SwiGLU MLP of width ~8d/3, rotary positions (RoPE, Su et
    al. 2021), no biases.

Cuttable layers: ``[embedding, block * num_layers, final norm + head]``; every cut carries one
``(N, T, embed_dim)`` float tensor, so a stage is any contiguous range of that list.

Deterministic slices. A peer that holds layers ``[a, b)`` of a 1B model must not build the other 4 GB.
`build_causal_lm_range` builds only the layers it is asked for, each from its own generator seeded by
``(base seed, layer index)`` (`layer_seed`), so layer ``i`` has the same weights whichever range it is built
in. The base seed is drawn from the global RNG, which `registry.build_model` / `build_layers` seed from
the job's seed: (config, seed) fixes every weight.

Tied embeddings. With ``tie_embeddings`` the head's weight starts equal to the token embedding (the head
is built from the embedding layer's seed). It is one shared tensor only when one build holds both the
first and the last layer (a one-stage pipeline); when they sit on different stages each trains its own
copy (they start tied and drift apart). Sharing a tensor across stages would need an extra gradient
exchange between the first and last stage each step; we do not do that. Untied is the default.

Presets (``preset``) set depth, width and heads; their parameter counts (vocab 50257, untied) are in
`PRESETS`' comments. Any field given explicitly overrides the preset.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

__all__ = ["PRESETS", "CausalLMConfig", "build_causal_lm", "build_causal_lm_range", "layer_seed"]

# (num_layers, embed_dim, num_heads); non-embedding parameters ~ 12 * L * d^2
PRESETS: dict[str, tuple[int, int, int]] = {
    "10m": (6, 384, 6),  # 10.6M in blocks
    "50m": (10, 640, 10),  # 49M
    "125m": (12, 768, 12),  # 85M (+77M embeddings untied at vocab 50257)
    "350m": (24, 1024, 16),  # 302M
    "760m": (24, 1536, 16),  # 680M
    "1b": (20, 2048, 16),  # 1.01B
}


class CausalLMConfig(BaseModel):
    """Config of `causal_lm`: inputs ``(N, block_size)`` int64 token ids, logits ``(N, T, vocab_size)``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: Literal["10m", "50m", "125m", "350m", "760m", "1b"] | None = None
    arch: Literal["gpt2", "llama"] = "gpt2"
    vocab_size: int = Field(default=128, ge=2)
    block_size: int = Field(default=64, ge=1)
    num_layers: int = Field(default=2, ge=1)
    num_heads: int = Field(default=2, ge=1)
    embed_dim: int = Field(default=64, ge=2)
    mlp_hidden: int | None = Field(default=None, ge=1, description="None: 4d (gpt2), ~8d/3 (llama)")
    tie_embeddings: bool = False
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    init_std: float = Field(default=0.02, gt=0.0)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            shape = PRESETS.get(data["preset"])
            if shape is not None:
                defaults = dict(zip(("num_layers", "embed_dim", "num_heads"), shape, strict=True))
                data = {**defaults, **data}
        return data

    @model_validator(mode="after")
    def _check_shape(self) -> CausalLMConfig:
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.arch == "llama" and (self.embed_dim // self.num_heads) % 2:
            raise ValueError("llama (rotary) needs an even head dimension")
        return self

    @property
    def hidden(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.arch == "gpt2":
            return 4 * self.embed_dim
        return 64 * math.ceil(8 * self.embed_dim / 3 / 64)

    @property
    def num_model_layers(self) -> int:
        """Cuttable layers: embedding, blocks, head."""
        return self.num_layers + 2


def layer_seed(base_seed: int, index: int) -> int:
    """The seed of layer ``index``'s generator: a hash of (base seed, index), stable across runs."""
    digest = hashlib.sha256(f"causal_lm/{base_seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(config: CausalLMConfig) -> nn.Module:
    return nn.LayerNorm(config.embed_dim) if config.arch == "gpt2" else RMSNorm(config.embed_dim)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Embedding(nn.Module):
    """Token embedding, plus learned positions for gpt2 (llama puts positions in attention)."""

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.embed_dim)
        self.position = nn.Embedding(config.block_size, config.embed_dim) if config.arch == "gpt2" else None
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.token(idx)
        if self.position is not None:
            x = x + self.position(torch.arange(idx.shape[1], device=idx.device))
        return self.dropout(x)


class Attention(nn.Module):
    """Causal multi-head attention (``scaled_dot_product_attention``), rotary for llama."""

    cos: Tensor
    sin: Tensor

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        bias = config.arch == "gpt2"
        self.num_heads = config.num_heads
        self.dropout_p = config.dropout
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim, bias=bias)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim, bias=bias)
        self.rotary = config.arch == "llama"
        self._head_dim = config.embed_dim // config.num_heads
        self._block_size = config.block_size
        if self.rotary:
            self.register_buffer("cos", torch.empty(0), persistent=False)
            self.register_buffer("sin", torch.empty(0), persistent=False)

    def reset_buffers(self) -> None:
        """Fill the rotary tables (after the module was built on the meta device)."""
        if self.rotary:
            dim = self._head_dim
            inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            angles = torch.outer(torch.arange(self._block_size, dtype=torch.float32), inv_freq)
            self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, x: Tensor) -> Tensor:
        n, t, c = x.shape
        q, k, v = (
            z.view(n, t, self.num_heads, c // self.num_heads).transpose(1, 2) for z in self.qkv(x).split(c, 2)
        )
        if self.rotary:
            q, k = _rotate(q, self.cos[:t], self.sin[:t]), _rotate(k, self.cos[:t], self.sin[:t])
        dropout_p = self.dropout_p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(n, t, c))


class MLP(nn.Module):
    """GELU MLP (gpt2) or SwiGLU (llama)."""

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        self.swiglu = config.arch == "llama"
        bias = not self.swiglu
        self.up = nn.Linear(config.embed_dim, (2 if self.swiglu else 1) * config.hidden, bias=bias)
        self.down = nn.Linear(config.hidden, config.embed_dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.swiglu:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        self.norm1 = _norm(config)
        self.attn = Attention(config)
        self.norm2 = _norm(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.dropout(self.attn(self.norm1(x)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class Head(nn.Module):
    """Final norm and the vocabulary projection (no bias)."""

    def __init__(self, config: CausalLMConfig) -> None:
        super().__init__()
        self.norm = _norm(config)
        self.out = nn.Linear(config.embed_dim, config.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))


def _init_weights(module: nn.Module, config: CausalLMConfig, generator: torch.Generator) -> None:
    """GPT-2 init: normal(0, init_std), residual projections scaled by 1/sqrt(2 L), zero biases."""
    residual_std = config.init_std / math.sqrt(2 * config.num_layers)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() < 2:
                param.fill_(1.0)  # norm gains
            else:
                std = residual_std if name.endswith(("proj.weight", "down.weight")) else config.init_std
                param.normal_(0.0, std, generator=generator)


def _build_layer(config: CausalLMConfig, base_seed: int, index: int) -> nn.Module:
    last = config.num_model_layers - 1
    cls: type[nn.Module] = Embedding if index == 0 else Head if index == last else Block
    # built on the meta device (no memory, no default init), then given real storage and initialised
    # once from the layer's own generator: the global RNG never decides a weight
    with torch.device("meta"):
        layer = cls(config)
    layer = layer.to_empty(device="cpu")
    for module in layer.modules():
        if isinstance(module, Attention):
            module.reset_buffers()
    generator = torch.Generator().manual_seed(layer_seed(base_seed, index))
    _init_weights(layer, config, generator)
    if index == last and config.tie_embeddings:
        head_from = torch.Generator().manual_seed(layer_seed(base_seed, 0))
        with torch.no_grad():
            token = torch.empty(config.vocab_size, config.embed_dim).normal_(
                0.0, config.init_std, generator=head_from
            )
            assert isinstance(layer, Head)
            layer.out.weight.copy_(token)
    return layer


def build_causal_lm_range(config: CausalLMConfig, start: int, end: int) -> list[nn.Module]:
    """Build layers ``[start, end)`` only, identical to those of a full build from the same RNG state.

    Draws the base seed from the global RNG (one draw, whatever the range), then builds each layer from
    ``layer_seed(base, index)``. With ``tie_embeddings`` and both ends in the range, the head shares the
    embedding's tensor.

    Raises:
        ValueError: an empty range or one outside the model.
    """
    n = config.num_model_layers
    if not 0 <= start < end <= n:
        raise ValueError(f"layers [{start}, {end}) outside a model of {n} layers")
    base_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    layers = [_build_layer(config, base_seed, i) for i in range(start, end)]
    if config.tie_embeddings and start == 0 and end == n:
        embedding, head = layers[0], layers[-1]
        assert isinstance(embedding, Embedding)
        assert isinstance(head, Head)
        head.out.weight = embedding.token.weight
    return layers


def build_causal_lm(config: CausalLMConfig) -> list[nn.Module]:
    """Build every layer: ``[embedding, block * num_layers, head]``."""
    return build_causal_lm_range(config, 0, config.num_model_layers)
