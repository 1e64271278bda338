"""Rewards for the haystack tasks: exact match and partial credit.

Every reward has the signature `(prompt: str, response: str, metadata: dict) -> float` in
[0, 1]; `register_haystack_rewards()` registers them in the reward registry
(`longstraw.grpo.rewards`) as "haystack_exact", "haystack_partial" and "haystack_shaped". They read the expected values from `metadata["values"]` (a list of strings, written by
the generator) or, for user datasets, parse them out of `metadata["answer"]` (plain "A, B" or
JSON '"A"' / '["A", "B"]').

Parsing the response (the same for both answer formats): split it into alphanumeric runs
(`[A-Za-z0-9]+`), drop runs equal to an asked key (`metadata["asked_keys"]`, so "Key 12 has
value 7" reads as 7), and keep the *candidates*: runs with the value's shape — exactly
`value_length` characters, all in `value_alphabet` (case-sensitive). Only the first candidates
count, so listing many guesses earns nothing extra. Without `value_alphabet`/`value_length` in
the metadata the shape is inferred from the expected values (their length; digits, letters, or
both).

- single answer (`kv_retrieval`, `multi_hop`): exact = 1 if the first candidate equals the
  value. Partial = positional character agreement with the value, divided by the longer of the
  two lengths; it reads the first candidate or, when none has the right length, the first run
  made of alphabet characters (so "12" against "123" earns 2/3, "1234" earns 3/4).
- several answers (`multi_needle`, k values): exact = 1 if the first k distinct candidates equal
  the values in the asked order. Partial = (asked values among the first k distinct
  candidates, in any order) / k.

Partial credit is never below exact match.
"""

from __future__ import annotations

import json
import re
import string
from typing import Any

from longstraw.grpo.rewards import register_reward

_RUN = re.compile(r"[A-Za-z0-9]+")


def _expected_values(metadata: dict[str, Any]) -> list[str]:
    values = metadata.get("values")
    if values is not None:
        return [str(v) for v in values]
    answer = metadata.get("answer")
    if answer is None:
        raise ValueError(
            "haystack rewards need metadata['values'] (list of strings) or metadata['answer']; "
            "put the record's answer into its metadata"
        )
    try:
        parsed = json.loads(answer)
    except (TypeError, ValueError):
        parsed = None
    if isinstance(parsed, list):
        return [str(v) for v in parsed]
    if isinstance(parsed, str):
        return [parsed]
    return _RUN.findall(str(answer))


def _value_shape(metadata: dict[str, Any], values: list[str]) -> tuple[set[str], int | None]:
    """(alphabet, length) of a value; length None means any length."""
    alphabet = metadata.get("value_alphabet")
    length = metadata.get("value_length")
    if alphabet is None:
        chars = set("".join(values))
        if chars <= set(string.digits):
            alphabet = string.digits
        elif chars <= set(string.ascii_letters):
            alphabet = string.ascii_letters
        else:
            alphabet = string.ascii_letters + string.digits
    if length is None and len({len(v) for v in values}) == 1:
        length = len(values[0])
    return set(alphabet), length


def _runs(response: str, metadata: dict[str, Any], alphabet: set[str]) -> list[str]:
    """Alphanumeric runs of the response made only of alphabet characters, asked keys removed."""
    asked = set(metadata.get("asked_keys", ()))
    return [r for r in _RUN.findall(response) if r not in asked and set(r) <= alphabet]


def _candidates(response: str, metadata: dict[str, Any], values: list[str]) -> list[str]:
    alphabet, length = _value_shape(metadata, values)
    runs = _runs(response, metadata, alphabet)
    return [r for r in runs if length is None or len(r) == length]


def _distinct(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def single_value_exact(response: str, metadata: dict[str, Any]) -> float:
    """1.0 if the response's first value-shaped run is the value, else 0.0."""
    values = _expected_values(metadata)
    candidates = _candidates(response, metadata, values)
    return float(bool(candidates) and candidates[0] == values[0])


def single_value_partial(response: str, metadata: dict[str, Any]) -> float:
    """Positional character agreement of the first candidate (or first alphabet-only run)
    with the value, over the longer length."""
    values = _expected_values(metadata)
    expected = values[0]
    candidates = _candidates(response, metadata, values)
    if not candidates:
        alphabet, _ = _value_shape(metadata, values)
        candidates = _runs(response, metadata, alphabet)
    if not candidates:
        return 0.0
    guess = candidates[0]
    agree = sum(g == e for g, e in zip(guess, expected, strict=False))
    return agree / max(len(guess), len(expected))


def multi_value_exact(response: str, metadata: dict[str, Any]) -> float:
    """1.0 if the first k distinct candidates are the k values in the asked order."""
    values = _expected_values(metadata)
    candidates = _distinct(_candidates(response, metadata, values))
    return float(candidates[: len(values)] == values)


def multi_value_partial(response: str, metadata: dict[str, Any]) -> float:
    """Fraction of the values found among the first k distinct candidates (any order)."""
    values = _expected_values(metadata)
    candidates = _distinct(_candidates(response, metadata, values))
    found = set(candidates[: len(values)]) & set(values)
    return len(found) / len(values)


def _is_multi(metadata: dict[str, Any]) -> bool:
    variant = metadata.get("variant")
    if variant is not None:
        return variant == "multi_needle"
    return len(_expected_values(metadata)) > 1


def haystack_exact(prompt: str, response: str, metadata: dict[str, Any]) -> float:
    """Exact-match reward for every haystack variant (see the module docstring)."""
    del prompt  # the answer is in the metadata
    fn = multi_value_exact if _is_multi(metadata) else single_value_exact
    return fn(response, metadata)


def haystack_partial(prompt: str, response: str, metadata: dict[str, Any]) -> float:
    """Partial-credit reward for every haystack variant (see the module docstring)."""
    del prompt
    fn = multi_value_partial if _is_multi(metadata) else single_value_partial
    return fn(response, metadata)


# Characters of a response the shaped reward looks at: an answer is short, and looking further
# would reward rambling in the value alphabet.
_SHAPED_WINDOW = 8


def haystack_shaped(prompt: str, response: str, metadata: dict[str, Any]) -> float:
    """1.0 for the exact answer; otherwise up to 0.5 for answering in the value alphabet.

    A dense signal for learning from scratch: a random tiny model almost never emits the exact
    value, so exact-match rewards are all zero and every advantage is zero. Half credit scales
    with the share of the response's first non-space characters drawn from the value alphabet.
    """
    if haystack_exact(prompt, response, metadata) == 1.0:
        return 1.0
    alphabet = set(metadata.get("value_alphabet", ""))
    chars = [c for c in response if not c.isspace()][:_SHAPED_WINDOW]
    if not alphabet or not chars:
        return 0.0
    return 0.5 * sum(c in alphabet for c in chars) / len(chars)


def register_haystack_rewards() -> None:
    """Register the three haystack rewards under their names (repeated calls are no-ops).

    The trainer calls this before it resolves `data.rewards`; call it yourself to score with
    `longstraw.grpo.rewards.score_group(["haystack_exact"], ...)` outside a run.
    """
    register_reward("haystack_exact", haystack_exact)
    register_reward("haystack_partial", haystack_partial)
    register_reward("haystack_shaped", haystack_shaped)
