"""Exact-mode gradient (cotangent accumulation + reverse shard sweep) against plain autograd.

Reference: full-sequence autograd over prompt+response, one sequence at a time, each response's
`branch_loss` share, summed over the group (`engine_helpers.reference_group_gradient`).

Measured (fp32, tiny checkpoints, P = 257, G = 3): every element within 1e-5 × |ref| +
2.5e-7 × max|ref| for all families and both loss types (largest absolute error 1.6e-7, qwen3); the absolute part is fp32 reordering
(chunked prefix attention, sharded gated delta rule) on gradients that range over 1e-9 .. 0.4.
"""

from __future__ import annotations

import pytest
from engine_helpers import (
    ENGINE_FAMILIES,
    assert_grads_close,
    random_group,
    reference_group_gradient,
    take_grads,
    vocab_of,
)

from longstraw.engine.group import accumulate_group_gradients
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig

PROMPT_LEN = 257  # T = 256 = 4 * 60 + 16: not a multiple of the shard size
SHARD_TOKENS = 60
RESPONSE_LENS = (9, 4, 13)


def _exact(model, prompt, responses, advantages, cfg, shard_tokens):
    stats = accumulate_group_gradients(
        model,
        prompt,
        responses,
        advantages,
        cfg,
        EngineConfig(shard_tokens=shard_tokens, prompt_grad="exact"),
    )
    assert stats.prompt_grad == "exact"
    return take_grads(model), stats


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_exact_gradient_matches_full_sequence_autograd(tiny_model, family, loss_type):
    model = tiny_model(family)
    cfg = GRPOConfig(loss_type=loss_type)
    prompt, responses, advantages = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    expected = reference_group_gradient(model, prompt, responses, advantages, cfg, path="full")
    actual, stats = _exact(model, prompt, responses, advantages, cfg, SHARD_TOKENS)
    assert stats.num_shards == 5
    assert_grads_close(actual, expected, what=f"{family}/{loss_type}")


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_one_shard_and_many_shards_give_the_same_exact_gradient(tiny_model, family):
    model = tiny_model(family)
    cfg = GRPOConfig(loss_type="grpo")
    prompt, responses, advantages = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    one, stats_one = _exact(model, prompt, responses, advantages, cfg, PROMPT_LEN)
    many, stats_many = _exact(model, prompt, responses, advantages, cfg, 37)
    assert (stats_one.num_shards, stats_many.num_shards) == (1, 7)
    assert_grads_close(many, one, what=f"{family} 7 shards vs 1")


@pytest.mark.parametrize(
    ("family", "shard_tokens"), [("qwen3_5", 1), ("qwen3_5", 2), ("qwen3_next", 3)]
)
def test_exact_gradient_with_tiny_shards_matches_full_sequence(tiny_model, family, shard_tokens):
    """Shards shorter than the conv tail (kernel - 1 = 3): each shard's start conv state holds
    inputs of several earlier shards, and the sweep must route their cotangent back through all."""
    model = tiny_model(family)
    cfg = GRPOConfig(loss_type="dapo")
    prompt, responses, advantages = random_group(20, (3, 1, 6), vocab_of(model))
    expected = reference_group_gradient(model, prompt, responses, advantages, cfg, path="full")
    actual, stats = _exact(model, prompt, responses, advantages, cfg, shard_tokens)
    assert stats.num_shards == -(-19 // shard_tokens)
    assert_grads_close(actual, expected, what=f"{family} shard={shard_tokens}")


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_exact_gradient_matches_full_sequence_autograd_at_1000(tiny_model, family):
    model = tiny_model(family)
    cfg = GRPOConfig(loss_type="grpo")
    prompt, responses, advantages = random_group(1000, (7, 12, 5), vocab_of(model))
    expected = reference_group_gradient(model, prompt, responses, advantages, cfg, path="full")
    actual, _ = _exact(model, prompt, responses, advantages, cfg, 300)
    assert_grads_close(actual, expected, what=f"{family} P=1000")


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_exact_gradient_with_blockwise_backward_in_small_blocks(tiny_model, family, monkeypatch):
    """The sweep's MLPs and delta rule recompute their backward 13 tokens at a time (blocks that
    are neither the shard nor a multiple of the delta rule's 64-token chunk)."""
    from longstraw.engine import sweep

    monkeypatch.setattr(sweep, "SWEEP_BLOCK_TOKENS", 13)
    model = tiny_model(family)
    cfg = GRPOConfig(loss_type="dapo")
    prompt, responses, advantages = random_group(PROMPT_LEN, RESPONSE_LENS, vocab_of(model))
    expected = reference_group_gradient(model, prompt, responses, advantages, cfg, path="full")
    actual, _ = _exact(model, prompt, responses, advantages, cfg, SHARD_TOKENS)
    assert_grads_close(actual, expected, what=f"{family} blocks of 13")
