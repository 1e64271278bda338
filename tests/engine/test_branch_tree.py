"""Shared turns once (`engine/branch_tree.py`): a prefix tree over the group's responses.

Reference: full-sequence autograd per response (prompt + response through transformers), each
response's loss-masked `branch_loss` share, summed — i.e. every branch computed separately.
The group: 3-turn trajectories that share their first turn (two of them also the second), one
response that is a prefix of others, one duplicate; segments of 3 tokens inside the nodes.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_grads_close, random_ids, vocab_of
from test_segmented_replay import (
    FAMILIES,
    PROMPT_LEN,
    _engine_grads,
    _full_sequence_grads,
    _masks,
    _without_indexer,
)

from longstraw.engine.branch_tree import build_prefix_tree
from longstraw.schemas.grpo import GRPOConfig


def _shared_group(vocab):
    turn1 = random_ids(7, vocab, seed=1)
    turn2a, turn2b = random_ids(5, vocab, seed=2), random_ids(4, vocab, seed=3)
    turn3 = random_ids(3, vocab, seed=4)
    responses = [
        torch.cat([turn1, turn2a, turn3]),
        torch.cat([turn1, turn2a, turn2b]),
        torch.cat([turn1, turn2b]),
        turn1.clone(),  # a prefix of the others: ends inside the tree
        torch.cat([turn1, turn2b]),  # a duplicate
    ]
    prompt = random_ids(PROMPT_LEN, vocab, seed=5)
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.2, 0.7])
    return prompt, responses, advantages


def test_prefix_tree_shares_the_common_turns():
    a, b, c = [1, 2, 3, 4], [1, 2, 3, 9, 9], [1, 2]
    (top,) = build_prefix_tree([a, b, c, [1, 2, 3, 4]])
    assert (top.start, top.end, top.responses) == (0, 2, [2])
    (mid,) = top.children
    assert (mid.start, mid.end, mid.responses) == (2, 3, [])
    spans = sorted((n.start, n.end, n.responses) for n in mid.children)
    assert spans == [(3, 4, [0, 3]), (3, 5, [1])]
    assert len(build_prefix_tree([[5], [6, 1]])) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_turns_give_the_gradient_of_separate_branches(tiny_model, family):
    model = tiny_model(family)
    cfg = GRPOConfig(loss_type="dapo")
    prompt, responses, advantages = _shared_group(vocab_of(model))
    masks = _masks([r.numel() for r in responses])
    expected = _full_sequence_grads(model, prompt, responses, advantages, masks, cfg)
    actual, _ = _shared_grads(model, prompt, responses, advantages, masks, cfg, "exact", 3)
    assert_grads_close(_without_indexer(actual), _without_indexer(expected), what=family)


@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_shared_turns_give_the_log_probs_and_gradient_of_separate_replay(tiny_model, mode):
    model = tiny_model("qwen3_5")
    cfg = GRPOConfig(loss_type="grpo")
    prompt, responses, advantages = _shared_group(vocab_of(model))
    masks = _masks([r.numel() for r in responses])
    separate, stats_sep = _engine_grads(
        model, prompt, responses, advantages, masks, cfg, mode, None
    )
    shared, stats_tree = _shared_grads(model, prompt, responses, advantages, masks, cfg, mode, None)
    assert_grads_close(shared, separate, what=f"tree vs separate, {mode}")
    for got, want in zip(stats_tree.branch_logprobs, stats_sep.branch_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert stats_tree.branch_losses == pytest.approx(stats_sep.branch_losses, rel=1e-5, abs=1e-8)


def _shared_grads(model, prompt, responses, advantages, masks, cfg, mode, segment):
    return _engine_grads(
        model, prompt, responses, advantages, masks, cfg, mode, segment, share_prefixes=True
    )
