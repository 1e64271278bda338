"""Configs of LongStraw's synthetic long-context tasks (the generators live in longstraw.data)."""

from __future__ import annotations

import string
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

HaystackVariant = Literal["kv_retrieval", "multi_needle", "multi_hop"]

_ALPHANUMERIC = set(string.ascii_letters + string.digits)


class HaystackTaskConfig(BaseModel):
    """A needle-in-a-haystack retrieval task of an exact prompt length."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["haystack"] = "haystack"
    """Task generator name (the registry key in `longstraw.data.tasks`)."""
    variant: HaystackVariant = "kv_retrieval"
    """`kv_retrieval`: ask the value of one key among many distractor records.
    `multi_needle`: ask the values of `num_needles` keys, answer is their list in asked order.
    `multi_hop`: a chain of `num_hops` pointer records (key -> key) ending in a value record;
    ask where the chain from its first key ends."""
    num_prompt_tokens: int = Field(ge=16, le=4_194_304)
    """Exact length of `prompt_ids` (haystack + question), in tokens of the given tokenizer."""
    num_needles: int = Field(default=1, ge=1, le=64)
    """Keys asked for: 1 for `kv_retrieval` and `multi_hop`, >= 2 for `multi_needle`."""
    num_hops: int = Field(default=0, ge=0, le=32)
    """Pointer records before the value in `multi_hop` (>= 1); 0 for the other variants."""
    key_length: int = Field(default=6, ge=1, le=12)
    """Characters per key."""
    key_alphabet: str = string.digits
    """Characters keys are drawn from (ASCII letters/digits, no repeats)."""
    value_length: int = Field(default=6, ge=1, le=32)
    """Characters per value."""
    value_alphabet: str = string.digits
    """Characters values are drawn from (ASCII letters/digits, no repeats). A small alphabet and
    `value_length=1` give a task a tiny random model can learn (see `tiny`)."""
    num_distinct_distractors: int = Field(default=1024, ge=0, le=65_536)
    """Distinct distractor records (keys other than the needles); each is tokenized once and
    repeats across a long haystack. Capped by the key space."""
    distractor_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """Probability that a body line is a distractor record rather than prose. The last few
    lines, chosen to hit the exact length, may be of either kind."""
    needle_depths: tuple[float, ...] | None = None
    """Relative positions in [0, 1] of the needle records in the body (one per record:
    `num_needles`, or `num_hops + 1` for `multi_hop`, in chain order). None: drawn from `seed`."""
    include_header: bool = True
    """Start the prompt with one line that says what the records are."""
    record_format: Literal["sentence", "compact"] = "sentence"
    """`sentence`: records read "Key 481932 has value 730144." and the prompt ends with a
    question ("Question: What is the value of key 481932? Answer:"). `compact` (kv_retrieval
    only): records read "Key 481932: 730144" and the prompt ends with the asked key's record up
    to its value ("Key 481932:"), which the answer completes: every repeat of a distractor
    record is then the same lookup as the question, which a small model learns from."""
    answer_format: Literal["plain", "json"] = "plain"
    """How the question asks for the answer: `plain` ("730144", or "730144, 118422" for
    several) or `json` ('"730144"', or '["730144", "118422"]'). Rewards accept either."""
    seed: int = Field(default=42, ge=0)
    """Seed of every random choice: same config and tokenizer give bitwise-equal ids."""
    check_tokenization: bool = True
    """Verify that the tokenizer does not merge tokens across line boundaries (so `prompt_ids`
    equals `encode(prompt_text())`); raise if it does."""

    @field_validator("key_alphabet", "value_alphabet")
    @classmethod
    def _alphabet_is_alphanumeric(cls, alphabet: str) -> str:
        if (
            not alphabet
            or not set(alphabet) <= _ALPHANUMERIC
            or len(set(alphabet)) != len(alphabet)
        ):
            raise ValueError(
                f"alphabet {alphabet!r} must be non-empty ASCII letters/digits without repeats, "
                "e.g. '0123456789' or 'ABCDEF'"
            )
        return alphabet

    @model_validator(mode="after")
    def _counts_fit_variant(self) -> HaystackTaskConfig:
        if self.variant == "multi_needle":
            if self.num_needles < 2:
                raise ValueError("multi_needle asks for several keys: set num_needles >= 2")
        elif self.num_needles != 1:
            raise ValueError(f"{self.variant} asks for one key: set num_needles=1")
        if self.record_format == "compact":
            if self.variant != "kv_retrieval":
                raise ValueError(
                    f"record_format 'compact' asks by completing one record: use variant "
                    f"kv_retrieval, or record_format 'sentence' for {self.variant}"
                )
            if self.answer_format != "plain":
                raise ValueError(
                    "record_format 'compact' completes a record with the plain value: set "
                    "answer_format 'plain'"
                )
        if self.variant == "multi_hop":
            if self.num_hops < 1:
                raise ValueError("multi_hop needs a chain: set num_hops >= 1")
        elif self.num_hops != 0:
            raise ValueError(f"num_hops is for multi_hop only: set num_hops=0 for {self.variant}")
        if self.needle_depths is not None:
            if len(self.needle_depths) != self.num_needle_records:
                raise ValueError(
                    f"needle_depths has {len(self.needle_depths)} entries; give one per needle "
                    f"record ({self.num_needle_records}) or None"
                )
            if not all(0.0 <= d <= 1.0 for d in self.needle_depths):
                raise ValueError("needle_depths must lie in [0, 1]")
        key_space = len(self.key_alphabet) ** self.key_length
        if key_space < self.num_needle_records:
            raise ValueError(
                f"only {key_space} distinct keys for {self.num_needle_records} needle keys: "
                "increase key_length or key_alphabet"
            )
        if self.variant == "multi_needle":
            value_space = len(self.value_alphabet) ** self.value_length
            if value_space < self.num_needles:
                raise ValueError(
                    f"only {value_space} distinct values for {self.num_needles} needles: "
                    "increase value_length or value_alphabet"
                )
        return self

    @property
    def num_needle_records(self) -> int:
        """Needle records inserted: one per asked key, or the whole chain for multi_hop."""
        return self.num_hops + 1 if self.variant == "multi_hop" else self.num_needles

    @classmethod
    def tiny(cls, **overrides) -> HaystackTaskConfig:
        """A short task for learning tests: 96 tokens, 2-digit keys, a 1-character value from
        'ABCD', a handful of distractor records and no header. Override any field."""
        fields = dict(
            num_prompt_tokens=96,
            key_length=2,
            value_length=1,
            value_alphabet="ABCD",
            num_distinct_distractors=8,
            distractor_fraction=1.0,
            include_header=False,
        )
        fields.update(overrides)
        return cls(**fields)
