"""The locally built byte-level BPE tokenizer: round trips, special tokens, determinism, and
the files `AutoTokenizer.from_pretrained` loads."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from longstraw.data.haystack import generate_haystack_task
from longstraw.models.tokenizer import (
    EOS_TOKEN,
    SPECIAL_TOKENS,
    build_hf_tokenizer,
    build_tokenizer,
)
from longstraw.schemas.data import HaystackTaskConfig

SEED = 42
TEXTS = [
    "The value of key 481932 is 730144.",
    "plain ascii, punctuation; [brackets] (parens) {braces} <angle> 'quotes' \"dq\" ~!@#$%^&*",
    "digits 0123456789 and 3.14159e-10 and -42",
    "unicode: naïve café — Straße, 東京, Привет, emoji 🧪🚀, math ∑∫√",
    "  leading and trailing spaces\tand tabs\nand\nnewlines\r\n  ",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(checkpoint_dir):
    """The tokenizer as a user loads it: AutoTokenizer from the checkpoint directory."""
    return AutoTokenizer.from_pretrained(str(checkpoint_dir("qwen3_5")))


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_haystack_records_round_trip_and_compress(tokenizer):
    task = HaystackTaskConfig(num_prompt_tokens=1001, seed=SEED)
    example = generate_haystack_task(task, tokenizer)
    text = example.prompt_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert ids == example.prompt_ids.tolist()
    # The BPE was trained on this kind of text: fewer tokens than bytes (measured 1.69 bytes/token
    # with the tiny 512-entry vocab; a byte-per-token fallback would give 1.0).
    assert len(text.encode()) / len(ids) > 1.5, len(text.encode()) / len(ids)


def test_special_tokens_are_single_ids_and_eos_is_zero(tokenizer):
    for token in SPECIAL_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert ids == [tokenizer.convert_tokens_to_ids(token)], (token, ids)
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.eos_token_id == 0
    assert tokenizer.pad_token_id == tokenizer.eos_token_id


def test_encoding_adds_no_special_tokens_by_default(tokenizer):
    text = TEXTS[0]
    assert tokenizer.encode(text) == tokenizer.encode(text, add_special_tokens=False)


def test_build_is_deterministic():
    a = build_tokenizer(vocab_size=512, seed=0)
    b = build_tokenizer(vocab_size=512, seed=0)
    assert a.to_str() == b.to_str()


def test_vocab_size_is_respected():
    tokenizer = build_hf_tokenizer(vocab_size=300)
    assert len(tokenizer) <= 300


def test_too_small_vocab_is_rejected_with_the_minimum():
    with pytest.raises(ValueError, match="vocab_size must be at least 259"):
        build_tokenizer(vocab_size=100)
