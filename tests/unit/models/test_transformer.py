"""causal_lm: both block styles train, a sliced build equals the full build's layers, presets scale, and a
stage of a big preset never allocates the other stages (issue 17, part 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ravnest_p2p.models import build_layers, build_model, count_layers, inter_layer_spec, parse_config
from ravnest_p2p.models.transformer import PRESETS, Block, CausalLMConfig, layer_seed
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.stages import build_stage

SMALL = {"vocab_size": 23, "block_size": 8, "num_layers": 3, "embed_dim": 16, "num_heads": 4}


def _tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(layer.named_parameters()), **dict(layer.named_buffers())}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("tie", [False, True])
def test_a_slice_equals_the_full_builds_layers(arch: str, tie: bool) -> None:
    config = {**SMALL, "arch": arch, "tie_embeddings": tie}
    full = build_model("causal_lm", config, seed=7)
    n = count_layers("causal_lm", config)
    assert n == len(full) == SMALL["num_layers"] + 2
    for start in range(n):
        for end in range(start + 1, n + 1):
            part = build_layers("causal_lm", config, seed=7, start=start, end=end)
            for a, b in zip(full[start:end], part, strict=True):
                ta, tb = _tensors(a), _tensors(b)
                assert ta.keys() == tb.keys()
                for name in ta:
                    assert torch.equal(ta[name], tb[name]), (start, end, name)
    other = build_model("causal_lm", config, seed=8)
    assert not torch.equal(full[1].attn.qkv.weight, other[1].attn.qkv.weight)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_model_learns_and_specs_match(arch: str) -> None:
    config = {**SMALL, "arch": arch}
    model = nn.Sequential(*build_model("causal_lm", config, seed=0))
    x = torch.randint(0, 23, (4, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 23), x.roll(-1, 1).reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    h = x
    for index, layer in enumerate(model):
        h = layer(h)
        spec = inter_layer_spec("causal_lm", config, index)
        assert (tuple(h.shape[1:]), h.dtype) == (spec.shape, spec.dtype)


def test_causality_a_later_token_does_not_change_earlier_logits() -> None:
    model = nn.Sequential(*build_model("causal_lm", {**SMALL, "arch": "llama"}, seed=0)).eval()
    x = torch.randint(0, 23, (1, 8))
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % 23
    with torch.no_grad():
        assert torch.allclose(model(x)[0, :-1], model(y)[0, :-1], atol=1e-6)


def test_tied_embeddings_share_one_tensor_only_within_one_build() -> None:
    config = {**SMALL, "tie_embeddings": True}
    full = build_model("causal_lm", config, seed=1)
    assert full[-1].out.weight is full[0].token.weight
    head = build_layers("causal_lm", config, seed=1, start=len(full) - 1, end=len(full))[0]
    assert torch.equal(head.out.weight, full[0].token.weight)  # starts tied on another stage
    untied = build_model("causal_lm", SMALL, seed=1)
    assert untied[-1].out.weight is not untied[0].token.weight


def test_presets_scale_from_10m_to_1b() -> None:
    def block_params(preset: str) -> int:
        config = CausalLMConfig(preset=preset)  # type: ignore[arg-type]
        with torch.device("meta"):  # shapes only, no memory
            layer = Block(config)
        return config.num_layers * sum(p.numel() for p in layer.parameters())

    assert 8e6 < block_params("10m") < 12e6
    assert 0.95e9 < block_params("1b") < 1.1e9
    sizes = [block_params(p) for p in PRESETS]
    assert sizes == sorted(sizes)
    assert parse_config("causal_lm", {"preset": "350m", "num_layers": 4}).num_layers == 4  # type: ignore[attr-defined]


def test_a_stage_of_the_1b_preset_holds_only_its_own_layers() -> None:
    job = JobSpec(model="causal_lm", model_params={"preset": "1b", "block_size": 16}, dataset="char_corpus")
    stage = build_stage(job, 5, 6, max_in_flight=1)
    held = sum(p.numel() for p in stage.module.parameters())
    assert held == 12 * 2048 * 2048 + 13 * 2048  # one block: qkv, proj, mlp (weights + biases), 2 norms
    assert stage.input_spec.shape == (16, 2048)


def test_layer_seeds_differ_by_index_and_base() -> None:
    seeds = {layer_seed(b, i) for b in range(3) for i in range(50)}
    assert len(seeds) == 150
