"""IST deal / write-back on `wide_mlp`: exact round trip, disjoint parts, traffic, refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ravnest_p2p.models import build_model, make_loss
from ravnest_p2p.strategies.ist import (
    ScaleRule,
    deal_hidden_units,
    extract_subnetwork,
    hidden_sizes,
    ist_bytes_per_worker,
    subnetwork_bytes,
    write_back,
)
from ravnest_p2p.strategies.ist_local import eval_layers, recalibrate_batchnorm, train_ist_round

CONFIG = {"in_features": 12, "hidden_features": [24, 16], "out_features": 5}


def _model(seed: int = 0) -> list[nn.Module]:
    layers = build_model("wide_mlp", CONFIG, seed=seed)
    # non-trivial BN statistics and counters, so the round trip checks buffers too
    nn.Sequential(*layers).train()(torch.randn(32, 12, generator=torch.Generator().manual_seed(1)))
    return layers


def _state(layers: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in nn.Sequential(*layers).state_dict().items()}


def test_deal_is_a_fresh_disjoint_partition_per_round_and_the_same_on_every_peer():
    a = deal_hidden_units([24, 16], 4, round_index=3, seed=7)
    b = deal_hidden_units([24, 16], 4, round_index=3, seed=7)
    c = deal_hidden_units([24, 16], 4, round_index=4, seed=7)
    for layer, size in enumerate([24, 16]):
        units = torch.cat(a.parts[layer])
        assert torch.equal(torch.sort(units).values, torch.arange(size))
        assert [len(p) for p in a.parts[layer]] == [size // 4] * 4
        assert all(torch.equal(x, y) for x, y in zip(a.parts[layer], b.parts[layer], strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.parts[0], c.parts[0], strict=True))
    uneven = deal_hidden_units([10], 3, round_index=0)
    assert sorted(len(p) for p in uneven.parts[0]) == [3, 3, 4]


@pytest.mark.parametrize("num_workers", [1, 2, 3, 4])
def test_deal_and_write_back_without_training_is_bit_exact(num_workers):
    layers = _model()
    before = _state(layers)
    deal = deal_hidden_units(hidden_sizes(layers), num_workers, round_index=5, seed=2)
    subnets = [extract_subnetwork(layers, deal, w) for w in range(num_workers)]
    with torch.no_grad():  # scribble over the full model: only the write-back may restore it
        for t in nn.Sequential(*layers).state_dict().values():
            t.zero_() if t.is_floating_point() else t.fill_(-1)
        # the middle matrix's off-diagonal blocks are not dealt: the caller keeps them, restore those
        for name, t in nn.Sequential(*layers).state_dict().items():
            if name == "1.0.weight":
                t.copy_(before[name])
    write_back(layers, deal, subnets)
    after = _state(layers)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_union_of_parts_covers_the_dealt_weights_exactly_once():
    layers = _model()
    deal = deal_hidden_units(hidden_sizes(layers), 4, round_index=0)
    subnets = [extract_subnetwork(layers, deal, w) for w in range(4)]
    first = sum(s[0][1].weight.numel() for s in subnets)
    middle = sum(s[1][1].weight.numel() for s in subnets)
    head = sum(s[2][1].weight.numel() for s in subnets)
    assert first == layers[0][1].weight.numel()
    assert head == layers[2].weight.numel()
    assert middle == layers[1][0].weight.numel() // 4  # diagonal blocks only: 1/n² each


def test_training_a_subnetwork_changes_only_its_units_and_the_shared_bias():
    layers = _model()
    before = _state(layers)
    deal = deal_hidden_units(hidden_sizes(layers), 2, round_index=1)
    subnets = [extract_subnetwork(layers, deal, w) for w in range(2)]
    with torch.no_grad():
        subnets[0][0][1].weight.add_(1.0)  # worker 0 moves its first-layer rows
        subnets[0][2][1].bias.add_(2.0)
    write_back(layers, deal, subnets)
    rows = deal.parts[0][0]
    others = deal.parts[0][1]
    assert torch.equal(layers[0][1].weight[rows], before["0.1.weight"][rows] + 1.0)
    assert torch.equal(layers[0][1].weight[others], before["0.1.weight"][others])
    torch.testing.assert_close(layers[2].bias, before["2.bias"] + 1.0)  # averaged over 2 workers


def test_train_rule_makes_a_single_worker_subnetwork_match_the_full_model_and_n_scales_inputs():
    layers = _model()
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(3))
    full = nn.Sequential(*layers).eval()
    deal = deal_hidden_units(hidden_sizes(layers), 1, round_index=0)
    sub = nn.Sequential(*extract_subnetwork(layers, deal, 0)).eval()
    with torch.no_grad():
        torch.testing.assert_close(sub(x), full(x))
    deal4 = deal_hidden_units(hidden_sizes(layers), 4, round_index=0)
    scaled = extract_subnetwork(layers, deal4, 0, scale_rule=ScaleRule.TRAIN)
    plain = extract_subnetwork(layers, deal4, 0, scale_rule=ScaleRule.TEST)
    assert scaled[2][0].factor == 4.0
    assert plain[2][0].factor == 1.0
    assert [m[0].factor for m in eval_layers(layers, 4, ScaleRule.TEST)[1:]] == [0.25, 0.25]
    assert eval_layers(layers, 4, ScaleRule.TRAIN) == layers


@pytest.mark.parametrize("num_workers", [1, 2, 4, 8])
def test_bytes_per_worker_closed_form_matches_the_extracted_subnetwork(num_workers):
    config = {"in_features": 20, "hidden_features": [32, 64, 16], "out_features": 6}
    layers = build_model("wide_mlp", config, seed=0)
    deal = deal_hidden_units(hidden_sizes(layers), num_workers, round_index=0)
    traffic = ist_bytes_per_worker(20, [32, 64, 16], 6, num_workers)
    for worker in range(num_workers):
        assert subnetwork_bytes(extract_subnetwork(layers, deal, worker)) == traffic.total_bytes
    full = nn.Sequential(*layers)
    assert traffic.full_model_bytes == sum(
        t.numel() * t.element_size() for t in (*full.parameters(), *full.buffers())
    )
    dealt_params = 20 * 32 + 16 * 6 + 2 * (32 + 64 + 16)  # first Linear, head weight, BN weight+bias
    dealt_buffers = 2 * (32 + 64 + 16)  # BN running mean+var
    assert traffic.dealt_bytes * num_workers == 4 * (dealt_params + dealt_buffers)
    assert traffic.block_bytes * num_workers**2 == 4 * (32 * 64 + 64 * 16)
    assert traffic.shared_bytes == 4 * 6 + 3 * 8


def test_bad_input_is_refused_and_changes_nothing():
    layers = _model()
    before = _state(layers)
    deal = deal_hidden_units(hidden_sizes(layers), 2, round_index=0)
    good = extract_subnetwork(layers, deal, 0)
    other = extract_subnetwork(layers, deal_hidden_units([24, 16], 3, round_index=0), 0)
    with pytest.raises(ValueError, match="expected 2 sub-networks"):
        write_back(layers, deal, [good])
    with pytest.raises(ValueError, match="do not match the deal"):
        write_back(layers, deal, [good, other])
    for t in nn.Sequential(*layers).state_dict():
        assert torch.equal(nn.Sequential(*layers).state_dict()[t], before[t])
    with pytest.raises(ValueError, match=">= 5 units"):
        deal_hidden_units([24, 4], 5, round_index=0)
    with pytest.raises(ValueError, match="worker must be"):
        extract_subnetwork(layers, deal, 2)
    with pytest.raises(ValueError, match="BatchNorm1d"):
        extract_subnetwork(build_model("mlp", {"hidden_features": [8]}), deal, 0)
    with pytest.raises(ValueError, match="multiples"):
        ist_bytes_per_worker(4, [10], 2, 3)


def test_in_process_round_trains_and_recalibration_restores_full_model_statistics():
    torch.manual_seed(0)
    layers = build_model(
        "wide_mlp", {"in_features": 8, "hidden_features": [32, 32], "out_features": 3}, seed=0
    )
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(256, 8, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    loss_fn = make_loss("cross_entropy")
    batches = [[(x[i::4][j : j + 16], y[i::4][j : j + 16]) for j in range(0, 64, 16)] for i in range(4)]
    first = train_ist_round(layers, batches, round_index=0, seed=0, lr=0.1, loss_fn=loss_fn)
    for r in range(1, 15):
        last = train_ist_round(layers, batches, round_index=r, seed=0, lr=0.1, loss_fn=loss_fn)
    assert sum(last) < sum(first)
    model = nn.Sequential(*layers).eval()
    recalibrate_batchnorm(model, [x[:128], x[128:]])
    assert not model.training
    with torch.no_grad():
        pre = model[0][1](x)  # the first hidden layer's pre-BN activations
    torch.testing.assert_close(model[0][2].running_mean, pre.mean(dim=0), atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        accuracy = (model.eval()(x).argmax(dim=1) == y).float().mean()
    assert accuracy > 0.6


def test_wide_mlp_at_paper_width_deals_a_quarter_of_the_first_layer_per_worker():
    layers = build_model("wide_mlp", {"hidden_features": [2048, 2048]}, seed=0)
    assert hidden_sizes(layers) == (2048, 2048)
    deal = deal_hidden_units(hidden_sizes(layers), 4, round_index=0)
    sub = extract_subnetwork(layers, deal, 3)
    assert sub[0][1].weight.shape == (512, 64)
    assert sub[1][1].weight.shape == (512, 512)
    assert subnetwork_bytes(sub) == ist_bytes_per_worker(64, [2048, 2048], 10, 4).total_bytes


def test_write_back_refuses_non_finite_or_wrong_dtype_subnetworks_and_changes_nothing():
    layers = _model()
    before = _state(layers)
    deal = deal_hidden_units(hidden_sizes(layers), 2, round_index=0)
    subnets = [extract_subnetwork(layers, deal, w) for w in range(2)]
    with torch.no_grad():
        subnets[1][1][1].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        write_back(layers, deal, subnets)
    subnets = [extract_subnetwork(layers, deal, w) for w in range(2)]
    subnets[0][2][1].double()
    with pytest.raises(ValueError, match="dtype"):
        write_back(layers, deal, subnets)
    after = _state(layers)
    assert all(torch.equal(before[k], after[k]) for k in before)
