"""Sharded no-grad prefill + prefix-cached branch replay against transformers' full forward.

Legend: P prompt tokens, T = P - 1 state tokens, R response tokens.

Measured (fp32, tiny checkpoints): max |logp - logp_full| <= 4.8e-7 for every family, P and shard
size below — one ulp of a log-prob near -6.2, far inside rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    ENGINE_FAMILIES,
    FP32_ATOL,
    FP32_RTOL,
    assert_close,
    full_sequence_logprobs,
    random_group,
    vocab_of,
)

from longstraw.engine.prefill import prefill
from longstraw.engine.replay import PromptCotangent, branch_logprobs, replay_branch

# R = 1 exercises the 1-token path of Gated DeltaNet (recurrent rule, conv over the tail only).
RESPONSE_LENS = (1, 6, 17)

# (P, shard_tokens): shard sizes that do not divide T = P - 1, and 1-3 token shards whose conv
# tails (kernel - 1 = 3 inputs) span several shards.
CASES = [(63, 10), (1000, 300), (23, 1), (23, 2), (23, 3)]
LONG_CASES = [("llama", 4097, 1000), ("qwen3_5", 4097, 1000)]


def _check_logprobs_match_full_forward(model, prompt_len: int, shard_tokens: int) -> None:
    prompt, responses, _ = random_group(prompt_len, RESPONSE_LENS, vocab_of(model))
    state = prefill(model, prompt, shard_tokens=shard_tokens)
    assert state.num_tokens == prompt_len - 1
    with torch.no_grad():
        for response in responses:
            actual = branch_logprobs(model, state, response)
            expected = full_sequence_logprobs(model, prompt, response)
            assert actual.dtype == torch.float32
            assert_close(
                actual,
                expected,
                what=f"P={prompt_len} shard={shard_tokens} R={response.numel()}",
                rtol=FP32_RTOL,
                atol=FP32_ATOL,
            )


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
@pytest.mark.parametrize(("prompt_len", "shard_tokens"), CASES)
def test_prefix_cached_replay_matches_full_sequence(tiny_model, family, prompt_len, shard_tokens):
    _check_logprobs_match_full_forward(tiny_model(family), prompt_len, shard_tokens)


@pytest.mark.parametrize(("family", "prompt_len", "shard_tokens"), LONG_CASES)
def test_prefix_cached_replay_matches_full_sequence_at_4097(
    tiny_model, family, prompt_len, shard_tokens
):
    _check_logprobs_match_full_forward(tiny_model(family), prompt_len, shard_tokens)


def test_single_token_prompt_replays_over_an_empty_state(tiny_model):
    # P = 1: the state covers no position; the branch alone is the whole sequence.
    model = tiny_model("qwen3_5")
    prompt, responses, _ = random_group(1, (5,), vocab_of(model))
    state = prefill(model, prompt, shard_tokens=4)
    with torch.no_grad():
        actual = branch_logprobs(model, state, responses[0])
    expected = full_sequence_logprobs(model, prompt, responses[0]).detach()
    assert_close(actual, expected, what="P=1", rtol=FP32_RTOL, atol=FP32_ATOL)


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_branch_replay_with_autograd_backpropagates_through_the_prefix_state(tiny_model, family):
    """The state comes from no_grad (not inference_mode), so a branch can save it."""
    model = tiny_model(family)
    prompt, responses, _ = random_group(63, (9,), vocab_of(model))
    state = prefill(model, prompt, shard_tokens=20)
    for name, tensor in state.tensors().items():
        assert not tensor.is_inference(), f"{name} is an inference tensor: cannot be saved"
        assert not tensor.requires_grad, name
    with torch.no_grad():
        no_grad_logp = branch_logprobs(model, state, responses[0])

    cotangent = PromptCotangent.zeros_like_state(state)
    logp, branch = replay_branch(model, state, responses[0], cotangent=cotangent)
    assert logp.requires_grad
    # Same ops with and without autograd: the values must not depend on grad mode.
    assert torch.equal(logp.detach(), no_grad_logp), (logp - no_grad_logp).abs().max()
    logp.sum().backward()
    branch.add_leaf_grads_into(cotangent)

    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is None or torch.isfinite(g).all() for g in grads.values())
    assert any(g is not None and g.abs().max() > 0 for g in grads.values())
    # The branch read the prefix: its cotangent is non-zero for every kind of state it holds.
    if cotangent.keys is not None:
        assert cotangent.keys.abs().max() > 0 and cotangent.values.abs().max() > 0
    if cotangent.recurrent is not None:
        assert cotangent.recurrent.abs().max() > 0 and cotangent.conv.abs().max() > 0
