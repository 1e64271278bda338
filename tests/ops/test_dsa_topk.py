"""The DSA top-k keep-mask against a stable descending sort, on tie-heavy scores."""

import pytest
import torch

from longstraw.ops.dsa_topk import naive_stable_topk_mask, stable_topk_indices, stable_topk_mask


def _tied_scores(shape, seed=42):
    generator = torch.Generator().manual_seed(seed)
    # Few distinct values (many exact ties) plus the exact zeros relu produces, and -inf masks.
    scores = torch.randint(-3, 4, shape, generator=generator).float().clamp(min=0.0) * 0.5
    masked = torch.rand(shape, generator=generator) < 0.2
    return scores.masked_fill(masked, float("-inf"))


@pytest.mark.parametrize("num,k", [(63, 32), (1000, 32), (1000, 999), (63, 63), (63, 200), (7, 1)])
def test_stable_topk_mask_matches_naive_stable_sort(num, k):
    scores = _tied_scores((2, 5, num))
    fast = stable_topk_mask(scores, k)
    ref = naive_stable_topk_mask(scores, k)
    mismatches = (fast != ref).sum().item()
    assert mismatches == 0, f"{mismatches} positions differ (num={num}, k={k})"
    assert (fast.sum(-1) == min(k, num)).all()


def test_ties_go_to_the_earlier_position():
    scores = torch.tensor([[[0.0, 1.0, 0.0, 1.0, 0.0, 0.0]]])
    keep = stable_topk_mask(scores, 3)
    assert keep.tolist() == [[[True, True, False, True, False, False]]]
    assert stable_topk_indices(scores, 3).tolist() == [[[1, 3, 0]]]


def test_stable_topk_mask_keeps_every_finite_score_when_fewer_than_k():
    scores = torch.tensor([[[2.0, float("-inf"), 1.0, float("-inf")]]])
    keep = stable_topk_mask(scores, 3)
    assert keep[0, 0, 0] and keep[0, 0, 2]
    assert keep.sum().item() == 3


def test_stable_topk_mask_rejects_non_positive_k():
    with pytest.raises(ValueError, match="index_topk"):
        stable_topk_mask(torch.zeros(1, 1, 4), 0)
