"""Branches replayed in segments (`engine/segmented_replay.py`) against full-sequence autograd.

Reference (exact mode): plain transformers autograd over prompt + response, one sequence at a
time, each response's `branch_loss` share with its loss mask, summed over the group. Detached
mode: the whole-branch replay (itself checked against transformers' cached path in
test_detached_gradient.py), which keeps the prompt state constant but differentiates through
the whole branch — what segmentation must reproduce.

Segments of 2 and 5 tokens: shorter than the Gated DeltaNet conv tail (kernel - 1 = 3) and not
dividing the responses, so the cotangent crosses several segment boundaries per conv window.
"""

from __future__ import annotations

import pytest
import torch
from dsa_reference import transformers_stable_topk
from engine_helpers import (
    ENGINE_FAMILIES,
    assert_grads_close,
    random_group,
    take_grads,
    vocab_of,
    zero_grads,
)

from longstraw.engine.branch_tree import segmented_branch_backward
from longstraw.engine.group import accumulate_group_gradients
from longstraw.engine.prefill import prefill
from longstraw.engine.recomputed_span import RecomputedStateMismatchError
from longstraw.grpo.losses import branch_loss, sequence_weights
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig

PROMPT_LEN = 41  # T = 40 = 2 * 16 + 8 over shards of 16
SHARD_TOKENS = 16
RESPONSE_LENS = (11, 4, 17)
FAMILIES = (*ENGINE_FAMILIES, "glm_moe_dsa")


def _masks(lengths):
    """Alternating assistant (1) / tool (0) runs: a 3-turn trajectory's loss mask per response."""
    masks = []
    for n in lengths:
        mask = torch.ones(n)
        mask[n // 3 : (2 * n) // 3] = 0.0  # the middle third is tool output
        masks.append(mask)
    return masks


def _full_sequence_grads(model, prompt, responses, advantages, masks, cfg):
    weights = sequence_weights(cfg.loss_type, [int(m.sum()) for m in masks], cfg)
    zero_grads(model)
    with transformers_stable_topk():
        for i, response in enumerate(responses):
            logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0]
            logp = logits[prompt.numel() - 1 : -1].float().log_softmax(-1)
            logp = logp.gather(-1, response[:, None])[:, 0]
            loss, _ = branch_loss(logp, None, float(advantages[i]), weights[i], cfg, None, masks[i])
            loss.backward()
    return take_grads(model)


def _engine_grads(
    model, prompt, responses, advantages, masks, cfg, mode, segment, *, share_prefixes=False
):
    zero_grads(model)
    stats = accumulate_group_gradients(
        model,
        prompt,
        responses,
        advantages,
        cfg,
        EngineConfig(
            shard_tokens=SHARD_TOKENS,
            prompt_grad=mode,
            branch_segment_tokens=segment,
            share_response_prefixes=share_prefixes,
        ),
        loss_masks=masks,
    )
    return take_grads(model), stats


def _without_indexer(grads):
    """GLM-5's indexer runs under no_grad in transformers: its parameters get no gradient."""
    return {n: g for n, g in grads.items() if ".indexer." not in n}


# Every family (GLM-5 included) runs segmented and shared in test_branch_tree.py.
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_segmented_exact_gradient_matches_full_sequence_autograd(tiny_model, family):
    model = tiny_model(family)
    cfg = GRPOConfig(loss_type="grpo")
    prompt, responses, advantages = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    masks = _masks(RESPONSE_LENS)
    expected = _full_sequence_grads(model, prompt, responses, advantages, masks, cfg)
    actual, stats = _engine_grads(model, prompt, responses, advantages, masks, cfg, "exact", 5)
    assert stats.num_tokens == [int(m.sum()) for m in masks]
    assert_grads_close(
        _without_indexer(actual), _without_indexer(expected), what=f"{family} segments of 5"
    )


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_segments_of_two_tokens_give_the_whole_branch_gradient(tiny_model, family):
    model = tiny_model(family)
    cfg = GRPOConfig(loss_type="dapo")
    prompt, responses, advantages = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    masks = _masks(RESPONSE_LENS)
    whole, _ = _engine_grads(model, prompt, responses, advantages, masks, cfg, "exact", None)
    segmented, _ = _engine_grads(model, prompt, responses, advantages, masks, cfg, "exact", 2)
    assert_grads_close(segmented, whole, what=f"{family} segments of 2 vs whole")


@pytest.mark.parametrize("family", ["qwen3_next", "glm_moe_dsa"])
def test_segmented_detached_gradient_matches_whole_branch_replay(tiny_model, family):
    """Detached: the prompt state is a constant, the branch's own earlier segments are not."""
    model = tiny_model(family)
    cfg = GRPOConfig(loss_type="grpo")
    prompt, responses, advantages = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    masks = _masks(RESPONSE_LENS)
    whole, _ = _engine_grads(model, prompt, responses, advantages, masks, cfg, "detached", None)
    segmented, _ = _engine_grads(model, prompt, responses, advantages, masks, cfg, "detached", 3)
    assert_grads_close(segmented, whole, what=f"{family} detached, segments of 3")


def test_segmented_log_probs_equal_the_whole_branch(tiny_model):
    model = tiny_model("qwen3_5")
    cfg = GRPOConfig(loss_type="grpo")
    prompt, responses, advantages = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    _, stats_whole = _engine_grads(model, prompt, responses, advantages, None, cfg, "exact", None)
    _, stats_seg = _engine_grads(model, prompt, responses, advantages, None, cfg, "exact", 4)
    for got, want in zip(stats_seg.branch_logprobs, stats_whole.branch_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert stats_seg.loss == pytest.approx(stats_whole.loss, rel=1e-5, abs=1e-7)


def test_a_branch_state_written_between_passes_is_rejected(tiny_model, monkeypatch):
    """The recomputation is checked against what the forward stored, bitwise."""
    import longstraw.engine.branch_tree as tree

    model = tiny_model("llama")
    cfg = GRPOConfig(loss_type="grpo")
    prompt, responses, _ = random_group(PROMPT_LEN, (9,), vocab_of(model))
    state = prefill(model, prompt, shard_tokens=SHARD_TOKENS)
    original = tree._segment_backward

    def corrupt_then_backward(model, prompt, branch, k, *rest):
        branch.keys[0, 1] += 1e-3
        return original(model, prompt, branch, k, *rest)

    monkeypatch.setattr(tree, "_segment_backward", corrupt_then_backward)

    def loss_fn(logp):
        return branch_loss(logp, None, 1.0, 1.0, cfg)

    with pytest.raises(RecomputedStateMismatchError, match="branch segment"):
        segmented_branch_backward(model, state, responses[0], loss_fn, segment_tokens=4)
    zero_grads(model)


def test_segment_length_must_be_positive(tiny_model):
    model = tiny_model("llama")
    prompt, responses, advantages = random_group(PROMPT_LEN, (3,), vocab_of(model))
    with pytest.raises(ValueError, match="branch_segment_tokens"):
        accumulate_group_gradients(
            model,
            prompt,
            responses,
            advantages,
            GRPOConfig(),
            EngineConfig(shard_tokens=SHARD_TOKENS, branch_segment_tokens=0),
        )


def test_run_config_takes_segments_and_shared_prefixes_on_several_ranks():
    # Both run on the ranks (tests/distributed/test_sharded_branches.py); they were refused.
    from longstraw.schemas.run import RunConfig

    config = RunConfig.model_validate(
        {
            "engine": {"branch_segment_tokens": 8, "share_response_prefixes": True},
            "parallel": {"world_size": 2},
        }
    )
    assert config.engine.branch_segment_tokens == 8
    assert config.engine.share_response_prefixes
