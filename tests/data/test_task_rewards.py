"""Haystack rewards: exact and partial credit on known answers, robust to surrounding text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from longstraw.data.rewards import (
    haystack_exact,
    haystack_partial,
    haystack_shaped,
    register_haystack_rewards,
)
from longstraw.grpo import rewards as registry

SINGLE = {
    "variant": "kv_retrieval",
    "values": ["482913"],
    "asked_keys": ["100200"],
    "value_alphabet": "0123456789",
    "value_length": 6,
}
HOP = SINGLE | {"variant": "multi_hop"}
MULTI = {
    "variant": "multi_needle",
    "values": ["111111", "222222", "333333"],
    "asked_keys": ["900001", "900002", "900003"],
    "value_alphabet": "0123456789",
    "value_length": 6,
}
TINY = {
    "variant": "kv_retrieval",
    "values": ["C"],
    "asked_keys": ["07"],
    "value_alphabet": "ABCD",
    "value_length": 1,
}


def rewards(response: str, metadata: dict) -> tuple[float, float]:
    return haystack_exact("", response, metadata), haystack_partial("", response, metadata)


@pytest.mark.parametrize("metadata", [SINGLE, HOP])
@pytest.mark.parametrize(
    ("response", "exact", "partial"),
    [
        ("482913", 1.0, 1.0),
        ("  482913\n", 1.0, 1.0),
        (" 482913. The chain ends there.", 1.0, 1.0),
        ('"482913"', 1.0, 1.0),
        ("Key 100200 has value 482913.", 1.0, 1.0),  # the asked key is not read as the answer
        ("The answer is 482913", 1.0, 1.0),
        ("482910", 0.0, 5 / 6),
        ("48291", 0.0, 5 / 6),  # too short: no candidate of the right length, read char by char
        ("4829133", 0.0, 6 / 7),
        ("999999 482913", 0.0, 1 / 6),  # only the first candidate counts (one 9 agrees)
        ("", 0.0, 0.0),
        ("I do not know.", 0.0, 0.0),
    ],
)
def test_single_value_rewards_score_known_responses(metadata, response, exact, partial):
    got = rewards(response, metadata)
    assert got == pytest.approx((exact, partial)), (response, got)


@pytest.mark.parametrize(
    ("response", "exact", "partial"),
    [
        ("111111, 222222, 333333", 1.0, 1.0),
        (' ["111111", "222222", "333333"]\nDone.', 1.0, 1.0),
        ("111111 222222 333333 444444", 1.0, 1.0),
        ("222222, 111111, 333333", 0.0, 1.0),  # all found, wrong order
        ("111111, 222222", 0.0, 2 / 3),
        ("111111, 111111, 444444, 333333", 0.0, 2 / 3),  # repeats count once
        ("444444, 555555, 666666, 111111", 0.0, 0.0),  # only the first k candidates count
        ("none", 0.0, 0.0),
    ],
)
def test_multi_needle_rewards_score_known_responses(response, exact, partial):
    got = rewards(response, MULTI)
    assert got == pytest.approx((exact, partial)), (response, got)


@pytest.mark.parametrize(
    ("response", "exact"),
    [(" C", 1.0), ("C.", 1.0), (" D", 0.0), (" c", 0.0), ("Key 07: C", 1.0), ("", 0.0)],
)
def test_tiny_task_rewards_read_a_single_letter(response, exact):
    assert rewards(response, TINY) == (exact, exact)


def test_rewards_fall_back_to_the_answer_string_of_a_user_record():
    assert rewards("Paris is it", {"answer": "Paris"}) == (1.0, 1.0)
    assert rewards(" 42", {"answer": '"42"'}) == (1.0, 1.0)
    assert rewards("7, 9", {"answer": '["7", "8"]'}) == (0.0, 0.5)
    with pytest.raises(ValueError, match="metadata\\['answer'\\]"):
        haystack_exact("", "x", {})


def test_registering_adds_the_three_rewards_to_the_one_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REWARDS", {})
    assert registry.reward_names() == []
    register_haystack_rewards()
    register_haystack_rewards()  # repeated calls are no-ops
    assert {
        name: registry.get_reward(name)
        for name in ("haystack_exact", "haystack_partial", "haystack_shaped")
    } == {
        "haystack_exact": haystack_exact,
        "haystack_partial": haystack_partial,
        "haystack_shaped": haystack_shaped,
    }
    assert registry.reward_names() == ["haystack_exact", "haystack_partial", "haystack_shaped"]


def test_shaped_reward_gives_full_credit_for_the_answer_and_half_for_the_alphabet():
    metadata = {"values": ["7"], "answer": "7", "value_alphabet": "0123456789", "value_length": 1}
    assert haystack_shaped("", " 7", metadata) == 1.0
    assert haystack_shaped("", " 3", metadata) == 0.5
    assert haystack_shaped("", " 3x", metadata) == 0.25
    assert haystack_shaped("", " ab", metadata) == 0.0
    assert haystack_shaped("", "   ", metadata) == 0.0


@settings(max_examples=examples(200), deadline=None)
@given(
    response=st.text(alphabet="0123456789 ,.abc\n", max_size=40),
    multi=st.booleans(),
)
def test_partial_credit_is_in_unit_interval_and_never_below_exact(response, multi):
    exact, partial = rewards(response, MULTI if multi else SINGLE)
    assert 0.0 <= exact <= partial <= 1.0, (response, exact, partial)


def test_generated_example_metadata_scores_its_own_answer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from longstraw.data import HaystackTaskConfig, generate_haystack_task

    # A byte-level BPE with few merges is enough here: only the metadata matters.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(["Key 123456 has value 654321.\n", "The river bends.\n"], trainer)
    for variant, extra in [
        ("kv_retrieval", {}),
        ("multi_needle", {"num_needles": 3}),
        ("multi_hop", {"num_hops": 2}),
    ]:
        for answer_format in ("plain", "json"):
            config = HaystackTaskConfig(
                variant=variant, num_prompt_tokens=2000, answer_format=answer_format, **extra
            )
            example = generate_haystack_task(config, tokenizer)
            completion = example.metadata["answer_completion"]
            assert rewards(completion, example.metadata) == (1.0, 1.0), (variant, completion)
            assert rewards(completion + "\nThat is all.", example.metadata) == (1.0, 1.0)
