"""Haystack task generator: exact length, determinism, needles where recorded, answers that the
decoded text itself supports (parsed here independently of the generator)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from longstraw.data import (
    HaystackTaskConfig,
    generate_haystack_task,
    generate_task,
    read_prompt_dataset,
    write_task_dataset,
)

VARIANTS = {
    "kv_retrieval": {},
    "multi_needle": {"num_needles": 3},
    "multi_hop": {"num_hops": 3},
}
# Short prompts fit fewer needles.
SMALL_VARIANTS = {
    "kv_retrieval": {},
    "multi_needle": {"num_needles": 2},
    "multi_hop": {"num_hops": 1},
}


def train_byte_level_bpe(add_prefix_space: bool = False, vocab_size: int = 700) -> Tokenizer:
    """A small real byte-level BPE trained on a few hundred generated lines (no download)."""
    rng = np.random.default_rng(42)
    words = [
        "the",
        "river",
        "old",
        "mill",
        "rain",
        "afternoon",
        "committee",
        "letters",
        "trains",
        "coast",
        "bakery",
        "bread",
        "boats",
        "storm",
        "notes",
        "library",
        "garden",
        "wall",
        "bridge",
        "visitors",
        "orchestra",
        "fox",
        "field",
        "museum",
        "maps",
    ]
    lines = []
    for _ in range(300):
        sentence = " ".join(rng.choice(words, size=int(rng.integers(4, 10))))
        key = "".join(rng.choice(list("0123456789"), size=6))
        value = "".join(rng.choice(list("0123456789ABCD"), size=int(rng.integers(1, 7))))
        lines += [
            sentence.capitalize() + ".\n",
            f"Key {key} has value {value}.\n",
            f"Key {key} points to key {value}.\n",
            f"Question: What is the value of key {key}? Answer: {value}\n",
        ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_byte_level_bpe()


def decode(tokenizer: Tokenizer, ids: np.ndarray) -> str:
    return tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def parse_expected_answer(text: str) -> list[str]:
    """Answer the question at the end of `text` from the records in it (test's own parser)."""
    values = dict(re.findall(r"^Key (\w+) has value (\w+)\.$", text, flags=re.MULTILINE))
    pointers = dict(re.findall(r"^Key (\w+) points to key (\w+)\.$", text, flags=re.MULTILINE))
    question = text[text.rindex("Question:") :]
    if "follow the pointers" in question:
        key = re.search(r"Start at key (\w+)", question).group(1)
        while key in pointers:
            key = pointers[key]
        return [values[key]]
    asked = re.search(r"keys? ([\w, ]+?)\?", question).group(1)
    return [values[k] for k in re.findall(r"\w+", asked) if k != "and"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_same_seed_gives_bitwise_equal_ids_and_another_seed_differs(tokenizer, variant):
    config = HaystackTaskConfig(variant=variant, num_prompt_tokens=1000, **VARIANTS[variant])
    a = generate_haystack_task(config, tokenizer)
    b = generate_haystack_task(config, tokenizer)
    c = generate_haystack_task(config.model_copy(update={"seed": 43}), tokenizer)
    assert a.prompt_ids.dtype == np.int32
    assert a.prompt_ids.tobytes() == b.prompt_ids.tobytes()
    assert a.metadata == b.metadata
    assert a.prompt_ids.tobytes() != c.prompt_ids.tobytes()
    assert a.metadata["asked_keys"] != c.metadata["asked_keys"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("num_prompt_tokens", [97, 1000, 4097])
def test_prompt_has_exactly_the_requested_length(tokenizer, variant, num_prompt_tokens):
    config = HaystackTaskConfig(
        variant=variant,
        num_prompt_tokens=num_prompt_tokens,
        key_length=3,
        value_length=2,
        include_header=num_prompt_tokens > 100,
        **SMALL_VARIANTS[variant],
    )
    example = generate_haystack_task(config, tokenizer)
    assert example.prompt_ids.shape == (num_prompt_tokens,)
    assert example.metadata["question_token_start"] + len(
        tokenizer.encode(example.metadata["question"]).ids
    ) == (num_prompt_tokens)


@pytest.mark.parametrize("variant", VARIANTS)
def test_needles_decode_from_their_recorded_positions(tokenizer, variant):
    config = HaystackTaskConfig(variant=variant, num_prompt_tokens=4097, **VARIANTS[variant])
    example = generate_haystack_task(config, tokenizer)
    needles = example.metadata["needles"]
    assert len(needles) == config.num_needle_records
    for needle in needles:
        start, n = needle["token_start"], needle["num_tokens"]
        text = decode(tokenizer, example.prompt_ids[start : start + n])
        assert text == needle["text"]
        assert text.startswith(f"Key {needle['key']} ")
        assert needle.get("value", needle.get("target")) in text
    question = decode(tokenizer, example.prompt_ids[example.metadata["question_token_start"] :])
    assert question == example.metadata["question"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", [42, 7])
def test_answer_follows_from_the_decoded_prompt(tokenizer, variant, seed):
    config = HaystackTaskConfig(
        variant=variant, num_prompt_tokens=3001, seed=seed, **VARIANTS[variant]
    )
    example = generate_haystack_task(config, tokenizer)
    text = decode(tokenizer, example.prompt_ids)
    expected = parse_expected_answer(text)
    assert expected == example.metadata["values"]
    assert example.answer == ", ".join(expected)
    assert decode(tokenizer, example.answer_ids) == " " + example.answer


@pytest.mark.parametrize("seed", [42, 7])
def test_compact_prompt_ends_with_the_asked_record_that_the_answer_completes(tokenizer, seed):
    config = HaystackTaskConfig(
        record_format="compact",
        num_prompt_tokens=2001,
        key_length=2,
        value_length=2,
        num_distinct_distractors=16,
        seed=seed,
    )
    example = generate_haystack_task(config, tokenizer)
    text = decode(tokenizer, example.prompt_ids)
    assert tokenizer.encode(text).ids == example.prompt_ids.tolist()
    body, _, last = text.rpartition("\n")
    (key,) = example.metadata["asked_keys"]
    assert last == f"Key {key}:" == example.metadata["question"]
    # The test's own reading of the records: every one is "Key K: V", the asked key's exactly once.
    records = re.findall(r"^Key (\w+): (\w+)$", body, flags=re.MULTILINE)
    assert len(records) == body.count("Key ") > 16
    assert [v for k, v in records if k == key] == example.metadata["values"]
    assert len({k for k, _ in records}) == 17  # the needle and the 16 distractors, repeated
    assert decode(tokenizer, example.answer_ids) == " " + example.answer
    (needle,) = example.metadata["needles"]
    start, n = needle["token_start"], needle["num_tokens"]
    assert (
        decode(tokenizer, example.prompt_ids[start : start + n]) == f"Key {key}: {example.answer}\n"
    )


def test_keys_values_and_depths_do_not_depend_on_the_tokenizer(tokenizer):
    coarse = train_byte_level_bpe(vocab_size=300)
    config = HaystackTaskConfig(variant="multi_hop", num_hops=3, num_prompt_tokens=10_001)
    a = generate_haystack_task(config, tokenizer)
    b = generate_haystack_task(config, coarse)
    assert a.prompt_ids.tobytes() != b.prompt_ids.tobytes()
    assert (a.answer, a.metadata["asked_keys"]) == (b.answer, b.metadata["asked_keys"])
    for x, y in zip(a.metadata["needles"], b.metadata["needles"], strict=True):
        assert x["text"] == y["text"]
        # Same requested depth; each lands on a line boundary (< 40 tokens away) in its body.
        assert abs(x["depth"] - y["depth"]) < 2 * 40 / 10_001 + 0.01, (x, y)


def test_asked_keys_appear_only_in_their_record_and_the_question(tokenizer):
    config = HaystackTaskConfig(variant="multi_needle", num_needles=4, num_prompt_tokens=20001)
    example = generate_haystack_task(config, tokenizer)
    text = example.prompt_text()
    for key in example.metadata["asked_keys"]:
        assert len(re.findall(rf"\b{key}\b", text)) == 2, key


def test_ids_are_the_canonical_encoding_of_the_prompt_text(tokenizer):
    config = HaystackTaskConfig(variant="multi_hop", num_hops=2, num_prompt_tokens=8191)
    example = generate_haystack_task(config, tokenizer)
    text = example.prompt_text()
    assert decode(tokenizer, example.prompt_ids) == text
    assert tokenizer.encode(text).ids == example.prompt_ids.tolist()


def test_transformers_tokenizer_gives_the_same_ids(tokenizer):
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    config = HaystackTaskConfig(variant="multi_needle", num_needles=2, num_prompt_tokens=2049)
    ours = generate_haystack_task(config, tokenizer)
    theirs = generate_haystack_task(config, wrapped)
    assert ours.prompt_ids.tobytes() == theirs.prompt_ids.tobytes()
    assert wrapped.decode(theirs.prompt_ids.tolist()) == theirs.prompt_text()


def test_plain_encode_only_tokenizer_is_accepted(tokenizer):
    class EncodeOnly:
        def encode(self, text):
            return tokenizer.encode(text).ids

    config = HaystackTaskConfig(num_prompt_tokens=1000)
    a = generate_haystack_task(config, EncodeOnly())
    b = generate_haystack_task(config, tokenizer)
    assert a.prompt_ids.tobytes() == b.prompt_ids.tobytes()


def test_given_needle_depths_place_the_needles_there(tokenizer):
    config = HaystackTaskConfig(
        variant="multi_needle",
        num_needles=3,
        num_prompt_tokens=10_001,
        needle_depths=(0.0, 0.5, 1.0),
    )
    example = generate_haystack_task(config, tokenizer)
    depths = [n["depth"] for n in example.metadata["needles"]]
    # Needles sit on line boundaries: within one line (< 40 tokens) of the requested depth.
    tolerance = 40 / config.num_prompt_tokens
    # depth 0: right after the header line
    first_start = example.metadata["needles"][0]["token_start"]
    before_first = decode(tokenizer, example.prompt_ids[:first_start])
    assert before_first.startswith("The lines below") and before_first.count("\n") == 1
    assert abs(depths[1] - 0.5) < tolerance, depths
    assert depths[2] > 0.97, depths  # depth 1: just before the question


def test_200k_token_prompt_is_generated_with_the_right_length(tokenizer):
    config = HaystackTaskConfig(variant="multi_hop", num_hops=4, num_prompt_tokens=200_003)
    example = generate_haystack_task(config, tokenizer)
    assert example.prompt_ids.shape == (200_003,)
    for needle in example.metadata["needles"]:
        start, n = needle["token_start"], needle["num_tokens"]
        assert decode(tokenizer, example.prompt_ids[start : start + n]) == needle["text"]


@pytest.mark.parametrize("num_prompt_tokens", [48, 64, 97, 128, 255])
def test_tiny_task_is_short_with_a_small_value_alphabet(tokenizer, num_prompt_tokens):
    config = HaystackTaskConfig.tiny(num_prompt_tokens=num_prompt_tokens)
    example = generate_haystack_task(config, tokenizer)
    assert example.prompt_ids.shape == (num_prompt_tokens,)
    assert example.answer in set("ABCD")
    assert parse_expected_answer(decode(tokenizer, example.prompt_ids)) == [example.answer]


def test_tiny_tasks_cover_every_answer_over_seeds(tokenizer):
    answers = {
        generate_haystack_task(HaystackTaskConfig.tiny(seed=s), tokenizer).answer for s in range(40)
    }
    assert answers == set("ABCD")


def test_json_answer_format_is_asked_for_and_returned(tokenizer):
    config = HaystackTaskConfig(
        variant="multi_needle", num_needles=2, num_prompt_tokens=1000, answer_format="json"
    )
    example = generate_haystack_task(config, tokenizer)
    assert json.loads(example.answer) == example.metadata["values"]
    assert "JSON list" in example.metadata["question"]


def test_prompt_too_short_for_its_needles_says_the_minimum(tokenizer):
    config = HaystackTaskConfig(variant="multi_needle", num_needles=8, num_prompt_tokens=40)
    with pytest.raises(ValueError, match=r"set num_prompt_tokens >= \d+"):
        generate_haystack_task(config, tokenizer)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"variant": "multi_needle", "num_needles": 1}, "num_needles >= 2"),
        ({"variant": "kv_retrieval", "num_needles": 3}, "set num_needles=1"),
        ({"variant": "multi_hop"}, "num_hops >= 1"),
        ({"variant": "kv_retrieval", "num_hops": 2}, "set num_hops=0"),
        ({"value_alphabet": "0-9"}, "ASCII letters/digits"),
        ({"value_alphabet": "AAB"}, "without repeats"),
        ({"key_length": 1, "variant": "multi_hop", "num_hops": 12}, "increase key_length"),
        ({"variant": "multi_needle", "num_needles": 3, "needle_depths": (0.5,)}, "one per needle"),
        ({"needle_depths": (1.5,)}, r"\[0, 1\]"),
        ({"num_prompt_tokens": 5_000_000}, "less than or equal"),
        ({"bogus": 1}, "Extra inputs"),
        ({"record_format": "compact", "variant": "multi_hop", "num_hops": 1}, "use variant kv_"),
        ({"record_format": "compact", "answer_format": "json"}, "set answer_format 'plain'"),
    ],
)
def test_bad_config_says_what_to_change(fields, message):
    with pytest.raises(ValueError, match=message):
        HaystackTaskConfig(**{"num_prompt_tokens": 1000, **fields})


def test_tokenizer_that_merges_across_lines_is_refused_unless_allowed():
    # add_prefix_space=True puts a space before every separately encoded line, so the pieces'
    # ids differ from the ids of the joined text.
    merging = train_byte_level_bpe(add_prefix_space=True)
    config = HaystackTaskConfig(num_prompt_tokens=1000)
    with pytest.raises(ValueError, match="check_tokenization=False"):
        generate_haystack_task(config, merging)
    example = generate_haystack_task(
        config.model_copy(update={"check_tokenization": False}), merging
    )
    assert example.prompt_ids.shape == (1000,)


def test_registry_dispatches_on_config_type_and_examples_round_trip_through_jsonl(
    tokenizer, tmp_path
):
    config = HaystackTaskConfig(variant="multi_hop", num_hops=1, num_prompt_tokens=501)
    example = generate_task(config, tokenizer)
    assert (
        example.prompt_ids.tobytes()
        == generate_haystack_task(config, tokenizer).prompt_ids.tobytes()
    )
    path = tmp_path / "tasks.jsonl"
    write_task_dataset(path, [("a", example)], reward="haystack_exact")
    (record,) = read_prompt_dataset(path)
    assert record.prompt_ids == example.prompt_ids.tolist()
    assert record.metadata == json.loads(json.dumps(example.metadata))
    assert record.answer == example.answer and record.reward == "haystack_exact"


def test_blockwise_gather_matches_naive_concatenation_across_blocks(tokenizer):
    # > 65,536 lines, so the gather crosses its block boundary.
    config = HaystackTaskConfig(variant="kv_retrieval", num_prompt_tokens=1_500_001)
    example = generate_haystack_task(config, tokenizer)
    assert example.piece_sequence.size > 1 << 16
    ids_K = [np.asarray(e.ids, dtype=np.int32) for e in tokenizer.encode_batch(example.piece_texts)]
    naive = np.concatenate([ids_K[k] for k in example.piece_sequence.tolist()])
    mismatches = np.flatnonzero(naive != example.prompt_ids)
    assert naive.shape == example.prompt_ids.shape and mismatches.size == 0, mismatches[:10]
