"""IST's blocks as flat indices, and the holder maps a networked IST fetches by."""

from __future__ import annotations

import torch

from ravnest_p2p.models import build_model
from ravnest_p2p.strategies import deal_hidden_units, extract_subnetwork, hidden_sizes
from ravnest_p2p.strategies.ist_blocks import EVERYONE, Holders, model_tensors, subnet_indices

MODEL = {"in_features": 8, "hidden_features": [12, 10, 9], "out_features": 3}


def test_indices_pick_exactly_the_sub_network_and_partition_the_dealt_entries() -> None:
    layers = build_model("wide_mlp", MODEL, seed=1)
    full = model_tensors(layers)
    deal = deal_hidden_units(hidden_sizes(layers), 3, round_index=4, seed=2)
    seen = [torch.zeros(t.numel(), dtype=torch.int64) for t in full.dealt]
    for position in range(3):
        sub = model_tensors(extract_subnetwork(layers, deal, position))
        indices = subnet_indices(layers, deal, position)
        for k, (f, s, index) in enumerate(zip(full.dealt, sub.dealt, indices, strict=True)):
            assert torch.equal(f.reshape(-1)[index], s.reshape(-1))
            seen[k][index] += 1
    # first layer, norms and head: every entry exactly once; middle matrices: the diagonal blocks
    assert all(int(c.max()) == 1 for c in seen)
    assert int(seen[0].sum()) == full.dealt[0].numel()
    assert int(seen[-1].sum()) == full.dealt[-1].numel()
    assert int(seen[5].sum()) < full.dealt[5].numel()  # the second hidden Linear: 1/n of its blocks


def test_holders_fall_back_to_the_newest_live_holder() -> None:
    layers = build_model("wide_mlp", {**MODEL, "hidden_features": [6, 6, 6]}, seed=0)
    start = Holders.initial(model_tensors(layers))
    sizes = hidden_sizes(layers)
    h0 = start.assign(layers, deal_hidden_units(sizes, 3, round_index=0), (0, 1, 2))
    h1 = h0.assign(layers, deal_hidden_units(sizes, 3, round_index=1), (0, 1, 2))
    assert all(int((m == EVERYONE).sum()) == 0 for m in (h1.maps[0], h1.maps[-1]))  # all rows trained
    fallen = h1.without([2], [h0, start])
    for k, m in enumerate(fallen.maps):
        assert not bool((m == 2).any())
        was_2 = h1.maps[k] == 2
        expected = torch.where(h0.maps[k][was_2] == 2, torch.full_like(m[was_2], EVERYONE), h0.maps[k][was_2])
        assert torch.equal(m[was_2], expected)
        assert torch.equal(m[~was_2], h1.maps[k][~was_2])
