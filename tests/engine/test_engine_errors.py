"""Bad input to the engine's public functions raises ValueError with a message that says what to
change; unsupported model families are named alongside the supported ones."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    FP32_ATOL,
    FP32_RTOL,
    SEED,
    assert_close,
    full_sequence_logprobs,
    random_group,
    vocab_of,
)
from transformers import AutoModelForCausalLM, GPT2Config

from longstraw.engine.group import accumulate_group_gradients
from longstraw.engine.prefill import prefill
from longstraw.engine.replay import branch_logprobs
from longstraw.models.factory import build_config
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig

CFG = GRPOConfig(loss_type="grpo")


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture
def group(llama):
    return random_group(20, (4, 6), vocab_of(llama))


def _accumulate(model, prompt, responses, advantages, **kwargs):
    engine = EngineConfig(shard_tokens=8)
    return accumulate_group_gradients(model, prompt, responses, advantages, CFG, engine, **kwargs)


def test_empty_prompt_is_rejected(llama, group):
    _, responses, advantages = group
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        prefill(llama, [], shard_tokens=8)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        _accumulate(llama, torch.tensor([], dtype=torch.long), responses, advantages)


@pytest.mark.parametrize("bad_id", [-1, 512, 10**6])
def test_ids_outside_the_vocabulary_are_rejected(llama, group, bad_id):
    prompt, responses, advantages = group
    assert vocab_of(llama) == 512
    bad_prompt = prompt.clone()
    bad_prompt[3] = bad_id
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 512\).*tokenizer"):
        prefill(llama, bad_prompt, shard_tokens=8)
    bad_response = responses[1].clone()
    bad_response[-1] = bad_id
    with pytest.raises(ValueError, match=r"responses\[1\] holds ids outside the vocabulary"):
        _accumulate(llama, prompt, [responses[0], bad_response], advantages)
    state = prefill(llama, prompt, shard_tokens=8)
    with pytest.raises(ValueError, match="response_ids holds ids outside the vocabulary"):
        branch_logprobs(llama, state, bad_response)


def test_ids_that_are_not_a_1d_integer_sequence_are_rejected(llama, group):
    prompt, _, _ = group
    with pytest.raises(ValueError, match="integer token ids"):
        prefill(llama, prompt.float(), shard_tokens=8)
    with pytest.raises(ValueError, match="1-D sequence"):
        prefill(llama, prompt.view(2, -1), shard_tokens=8)


def test_empty_response_is_rejected(llama, group):
    prompt, responses, advantages = group
    with pytest.raises(ValueError, match=r"responses\[1\] is empty"):
        _accumulate(llama, prompt, [responses[0], []], advantages)
    with pytest.raises(ValueError, match="responses is empty"):
        _accumulate(llama, prompt, [], [])
    state = prefill(llama, prompt, shard_tokens=8)
    with pytest.raises(ValueError, match="response_ids is empty"):
        branch_logprobs(llama, state, [])


def test_advantages_of_the_wrong_length_are_rejected(llama, group):
    prompt, responses, _ = group
    with pytest.raises(ValueError, match="advantages has 3 entries for 2 responses"):
        _accumulate(llama, prompt, responses, [1.0, -1.0, 0.5])
    with pytest.raises(ValueError, match="advantages must be finite"):
        _accumulate(llama, prompt, responses, [1.0, float("nan")])


def test_old_ref_logprobs_and_masks_of_the_wrong_length_are_rejected(llama, group):
    prompt, responses, advantages = group
    with pytest.raises(ValueError, match="old_logprobs has 1 entries but there are 2 responses"):
        _accumulate(llama, prompt, responses, advantages, old_logprobs=[torch.zeros(4)])
    with pytest.raises(ValueError, match=r"old_logprobs\[1\] has 5 entries for a 6-token response"):
        _accumulate(
            llama, prompt, responses, advantages, old_logprobs=[torch.zeros(4), torch.zeros(5)]
        )
    with pytest.raises(ValueError, match=r"loss_masks\[0\] has 3 entries for a 4-token response"):
        _accumulate(llama, prompt, responses, advantages, loss_masks=[torch.ones(3), torch.ones(6)])
    with pytest.raises(ValueError, match=r"beta=0\.1 needs ref_logprobs"):
        accumulate_group_gradients(
            llama, prompt, responses, advantages, GRPOConfig(beta=0.1), EngineConfig(shard_tokens=8)
        )


def test_unknown_prompt_grad_and_bad_shard_size_are_rejected(llama, group):
    prompt, responses, advantages = group
    with pytest.raises(ValueError, match=r"prompt_grad\n  Input should be 'exact' or 'detached'"):
        EngineConfig(prompt_grad="approximate")
    with pytest.raises(ValueError, match=r"engine must be a longstraw\.EngineConfig"):
        accumulate_group_gradients(
            llama, prompt, responses, advantages, CFG, {"prompt_grad": "approximate"}
        )
    with pytest.raises(ValueError, match="shard_tokens must be >= 1"):
        prefill(llama, prompt, shard_tokens=0)
    with pytest.raises(ValueError, match="GRPOConfig"):
        accumulate_group_gradients(
            llama, prompt, responses, advantages, {}, EngineConfig(shard_tokens=8)
        )


def _llama_with(max_positions: int, rope_parameters: dict | None = None):
    config = build_config("llama", "tiny")
    config.max_position_embeddings = max_positions
    if rope_parameters is not None:
        config.rope_parameters = rope_parameters
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(config).eval()


def test_positions_beyond_the_model_range_are_rejected_without_rope_scaling():
    model = _llama_with(64)
    prompt, responses, advantages = random_group(65, (4,), vocab_of(model))
    with pytest.raises(ValueError, match=r"65 positions.*max_position_embeddings is 64.*rope_"):
        prefill(model, prompt, shard_tokens=16)
    # A prompt that fits, with a response that does not.
    state = prefill(model, prompt[:60], shard_tokens=16)
    with pytest.raises(ValueError, match=r"prompt \+ response needs 70 positions"):
        branch_logprobs(model, state, torch.arange(10))
    with pytest.raises(ValueError, match="max_position_embeddings is 64"):
        _accumulate(model, prompt, responses, advantages)


def test_a_response_that_cannot_fit_is_refused_before_the_prefill(monkeypatch):
    """The check runs on prompt + longest response before any compute: a benchmark once
    prefilled 128K tokens for 14 minutes and then failed on the first branch."""
    from longstraw.engine import group as group_module

    model = _llama_with(64)
    prompt, responses, advantages = random_group(60, (3, 9), vocab_of(model))

    def no_prefill(*args, **kwargs):
        raise AssertionError("prefill ran before the position check")

    monkeypatch.setattr(group_module, "prefill", no_prefill)
    with pytest.raises(ValueError, match=r"prompt \+ longest response needs 69 positions"):
        _accumulate(model, prompt, responses, advantages)


def test_positions_beyond_the_model_range_are_allowed_with_rope_scaling():
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    model = _llama_with(64, rope)
    prompt, responses, _ = random_group(100, (7,), vocab_of(model))
    state = prefill(model, prompt, shard_tokens=30)
    with torch.no_grad():
        actual = branch_logprobs(model, state, responses[0])
        expected = full_sequence_logprobs(model, prompt, responses[0])
    assert_close(actual, expected, what="linear RoPE, P=100 > 64", rtol=FP32_RTOL, atol=FP32_ATOL)


def test_unsupported_family_gets_an_error_naming_the_supported_ones():
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt, responses, advantages = random_group(20, (4,), 100)
    expected = r"model_type 'gpt2' is not supported.*llama.*qwen3.*qwen3_5.*qwen3_next"
    with pytest.raises(ValueError, match=expected):
        prefill(model, prompt, shard_tokens=8)
    with pytest.raises(ValueError, match=expected):
        _accumulate(model, prompt, responses, advantages)
