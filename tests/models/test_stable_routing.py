"""Stable expert selection: torch.topk's choice on distinct scores, the earlier index on ties."""

from __future__ import annotations

import torch

from longstraw.models.stable_routing import stable_routing_installed, stable_topk


def test_stable_topk_matches_topk_on_distinct_scores():
    scores = torch.randn(63, 16, generator=torch.Generator().manual_seed(42))
    values, indices = stable_topk(scores, 4)
    ref_values, ref_indices = torch.topk(scores, 4)
    assert torch.equal(values, ref_values)
    assert torch.equal(indices, ref_indices)


def test_stable_topk_breaks_ties_toward_the_earlier_index():
    scores = torch.tensor([[0.1, 0.5, 0.5, 0.2, 0.5]])
    _, indices = stable_topk(scores, 2)
    assert indices.tolist() == [[1, 2]]


def test_router_forward_is_restored_and_unchanged_without_ties(load_tiny):
    model = load_tiny("qwen3_next")
    router = next(m for m in model.modules() if type(m).__name__ == "Qwen3NextTopKRouter")
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(42))
    stock = router(x)
    with stable_routing_installed(model):
        patched = router(x)
        assert "forward" in vars(router)
    assert "forward" not in vars(router)
    for a, b in zip(stock, patched, strict=True):
        assert torch.equal(a, b)


def test_glm_router_picks_the_same_experts_without_ties(load_tiny):
    model = load_tiny("glm_moe_dsa")
    router = next(m for m in model.modules() if type(m).__name__ == "GlmMoeDsaTopkRouter")
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(42))
    _, stock_weights, stock_indices = router(x)
    with stable_routing_installed(model):
        _, weights, indices = router(x)
    # torch.topk(sorted=False) may list the experts in another order: compare as sets of pairs.
    for row in range(x.shape[0]):
        stock = dict(zip(stock_indices[row].tolist(), stock_weights[row].tolist(), strict=True))
        ours = dict(zip(indices[row].tolist(), weights[row].tolist(), strict=True))
        assert stock.keys() == ours.keys()
        for expert, weight in ours.items():
            assert abs(weight - stock[expert]) <= 1e-6
