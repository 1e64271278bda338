"""Rollout: G responses sampled in one batch from the shared prompt state.

Legend: P prompt tokens, G rows, R response tokens, V vocab.

The sampler's recorded log-probs must be what training computes on the same tokens (a
`branch_logprobs` replay one branch at a time), the prompt state must come out untouched, and
the controls (stop ids/strings, top-k/top-p, max_new_tokens, seeds) must do what they say.
"""

from __future__ import annotations

import pytest
import torch

from longstraw.engine.prefill import prefill
from longstraw.engine.replay import branch_cache, branch_input_ids, replay_logits
from longstraw.engine.rollout import (
    SamplingParams,
    _filter_logits,
    decode_response,
    sample_responses,
    score_responses,
)
from tests.engine.engine_helpers import assert_close, random_ids, vocab_of

SEED = 42
PROMPT_LEN = 63
SHARD_TOKENS = 17  # 62 state tokens: four shards, the last one short
# The sampler takes log_softmax of the last position of a batched step forward, the replay of the
# whole branch at once: the same fp32 math in another order (STYLE.md: rtol 1e-5 / atol 1e-6;
# the brief's bound is 1e-5 absolute). Measured max_diff: see test output on failure.
LOGP_ATOL = 1e-5


def make_state(model, *, prompt_len: int = PROMPT_LEN):
    prompt = random_ids(prompt_len, vocab_of(model), seed=SEED)
    return prefill(model, prompt, shard_tokens=SHARD_TOKENS)


def generator(seed: int = SEED) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def naive_filter_logits(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row, written out token by token: top-k, then min-p, then the smallest top-p nucleus."""
    logits = logits_V.clone()
    if params.top_k is not None:
        kth = sorted(logits.tolist(), reverse=True)[min(params.top_k, logits.numel()) - 1]
        logits[logits < kth] = float("-inf")
    probs = torch.softmax(logits, -1)
    if params.min_p is not None:
        logits[probs < probs.max() * params.min_p] = float("-inf")
        probs = torch.softmax(logits, -1)
    if params.top_p < 1.0:
        mass, keep = 0.0, set()
        for index in sorted(range(probs.numel()), key=lambda i: -float(probs[i])):
            if mass >= params.top_p:
                break
            keep.add(index)
            mass += float(probs[index])
        for index in range(probs.numel()):
            if index not in keep:
                logits[index] = float("-inf")
    return logits


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_sampled_logprobs_match_branch_replay(tiny_model, family):
    model = tiny_model(family)
    state = make_state(model)
    params = SamplingParams(num_samples=5, max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=50)
    responses = sample_responses(model, state, params, generator=generator())
    replayed = score_responses(model, state, [r.token_ids for r in responses], temperature=0.7)
    for row, (response, logp) in enumerate(zip(responses, replayed, strict=True)):
        assert len(response.token_ids) == len(response.logprobs) == 7
        assert_close(
            torch.tensor(response.logprobs),
            logp,
            what=f"{family} row {row}",
            rtol=0.0,
            atol=LOGP_ATOL,
        )
    # The rows differ (each row's Gated DeltaNet state is its own fork, not shared by reference).
    assert len({tuple(r.token_ids) for r in responses}) > 1


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_rollout_leaves_the_prompt_state_bitwise_unchanged(tiny_model, family):
    model = tiny_model(family)
    state = make_state(model)
    before = {name: t.clone() for name, t in state.tensors().items()}
    sample_responses(
        model, state, SamplingParams(num_samples=4, max_new_tokens=5), generator=generator()
    )
    after = state.tensors()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), f"{family}: {name} changed during rollout"


def test_stop_token_ends_a_row_and_is_kept(tiny_model):
    model = tiny_model("qwen3_5")
    state = make_state(model)
    free = sample_responses(
        model, state, SamplingParams(num_samples=6, max_new_tokens=6), generator=generator()
    )
    stop = free[0].token_ids[2]
    stopped = sample_responses(
        model,
        state,
        SamplingParams(num_samples=6, max_new_tokens=6, stop_token_ids=(stop,)),
        generator=generator(),
    )
    # Every row draws from the same generator stream, so a stopped row is the free row cut after
    # its first stop token (inclusive).
    for row, (a, b) in enumerate(zip(free, stopped, strict=True)):
        if stop in a.token_ids:
            cut = a.token_ids.index(stop) + 1
            assert b.token_ids == a.token_ids[:cut], row
            assert b.logprobs == a.logprobs[:cut], row
            assert b.finish_reason == "stop" and not b.truncated
        else:
            assert b.token_ids == a.token_ids and b.finish_reason == "length" and b.truncated
    assert stopped[0].token_ids[-1] == stop and len(stopped[0].token_ids) <= 3


def test_stop_string_ends_a_row(tiny_model, checkpoint_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir("qwen3_5")))
    model = tiny_model("qwen3_5")
    state = make_state(model)
    free = sample_responses(
        model, state, SamplingParams(num_samples=4, max_new_tokens=6), generator=generator()
    )
    marker = tokenizer.decode(free[1].token_ids[:3])[-1]
    params = SamplingParams(num_samples=4, max_new_tokens=6, stop_strings=(marker,))
    stopped = sample_responses(model, state, params, generator=generator(), tokenizer=tokenizer)
    for a, b in zip(free, stopped, strict=True):
        if b.finish_reason == "stop":
            assert marker in b.text and marker not in tokenizer.decode(b.token_ids[:-1])
            assert a.token_ids[: len(b.token_ids)] == b.token_ids
        else:
            assert marker not in b.text and b.token_ids == a.token_ids
    assert stopped[1].finish_reason == "stop" and len(stopped[1].token_ids) <= 3


def test_response_text_leaves_out_special_tokens(checkpoint_dir):
    """Rewards see the completion without `<|endoftext|>` (TRL decodes completions with
    skip_special_tokens=True): the stop token is kept in the ids but is not text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir("qwen3_5")))
    ids = [*tokenizer.encode("B C", add_special_tokens=False), tokenizer.eos_token_id]
    assert decode_response(tokenizer, ids) == "B C"


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_top_k_one_is_greedy_argmax_of_replay_logits(tiny_model, family):
    model = tiny_model(family)
    state = make_state(model)
    params = SamplingParams(num_samples=3, max_new_tokens=6, temperature=0.5, top_k=1)
    responses = sample_responses(model, state, params, generator=generator())
    assert all(r.token_ids == responses[0].token_ids for r in responses)
    ids = torch.tensor(responses[0].token_ids)
    with torch.no_grad():
        logits_RV = replay_logits(
            model, state, branch_input_ids(state, ids).unsqueeze(0), branch_cache(state).cache
        )[0]
    assert logits_RV.argmax(-1).tolist() == responses[0].token_ids


def test_same_seed_gives_the_same_responses_and_another_seed_does_not(tiny_model):
    model = tiny_model("qwen3_5")
    state = make_state(model)
    params = SamplingParams(num_samples=4, max_new_tokens=5)
    a = sample_responses(model, state, params, generator=generator(SEED))
    b = sample_responses(model, state, params, generator=generator(SEED))
    c = sample_responses(model, state, params, generator=generator(SEED + 1))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


@pytest.mark.parametrize("max_new_tokens", [1, 3, 8])
def test_max_new_tokens_is_respected(tiny_model, max_new_tokens):
    model = tiny_model("llama")
    state = make_state(model)
    params = SamplingParams(num_samples=3, max_new_tokens=max_new_tokens)
    for response in sample_responses(model, state, params, generator=generator()):
        assert len(response.token_ids) == max_new_tokens
        assert response.finish_reason == "length" and response.truncated


def test_single_token_prompt_samples_from_an_empty_state(tiny_model):
    model = tiny_model("qwen3_5")
    state = make_state(model, prompt_len=1)
    params = SamplingParams(num_samples=2, max_new_tokens=4)
    responses = sample_responses(model, state, params, generator=generator())
    replayed = score_responses(model, state, [r.token_ids for r in responses])
    for response, logp in zip(responses, replayed, strict=True):
        assert_close(torch.tensor(response.logprobs), logp, what="P=1", rtol=0.0, atol=LOGP_ATOL)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(num_samples=1, max_new_tokens=1, top_k=7),
        SamplingParams(num_samples=1, max_new_tokens=1, top_p=0.6),
        SamplingParams(num_samples=1, max_new_tokens=1, min_p=0.3),
        SamplingParams(num_samples=1, max_new_tokens=1, top_k=40, min_p=0.05, top_p=0.8),
    ],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_filter_logits_matches_naive_filter(params):
    logits_GV = torch.randn(3, 101, generator=generator()) * 2.0
    fast = _filter_logits(logits_GV, params)
    for row in range(3):
        expected = naive_filter_logits(logits_GV[row], params)
        assert torch.equal(torch.isinf(fast[row]), torch.isinf(expected)), row
        kept = ~torch.isinf(expected)
        assert torch.equal(fast[row][kept], expected[kept])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_samples=0, max_new_tokens=1), "num_samples must be >= 1"),
        (dict(num_samples=1, max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(num_samples=1, max_new_tokens=1, temperature=0.0), "temperature must be > 0"),
        (dict(num_samples=1, max_new_tokens=1, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(num_samples=1, max_new_tokens=1, top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(num_samples=1, max_new_tokens=1, top_k=0), "top_k must be >= 1 or None"),
        (dict(num_samples=1, max_new_tokens=1, min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(num_samples=1, max_new_tokens=1, min_p=-0.1), r"min_p must be in \[0, 1\]"),
    ],
)
def test_bad_sampling_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_strings_without_a_tokenizer_are_rejected(tiny_model):
    model = tiny_model("llama")
    state = make_state(model)
    params = SamplingParams(num_samples=1, max_new_tokens=2, stop_strings=("\n",))
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        sample_responses(model, state, params)


def test_rollout_past_max_positions_is_rejected(tiny_model):
    model = tiny_model("llama")
    state = make_state(model)
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_new_tokens"):
        sample_responses(model, state, SamplingParams(num_samples=1, max_new_tokens=limit))
