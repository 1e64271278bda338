"""Reward registry, user functions by 'package.module:function', and group scoring."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest

from longstraw.grpo import rewards as registry
from longstraw.grpo.rewards import get_reward, register_reward, reward_names, score_group


@pytest.fixture
def registered(monkeypatch):
    """Two test rewards in an otherwise empty registry, restored afterwards."""
    monkeypatch.setattr(registry, "_REWARDS", {})

    @register_reward("test_length")
    def length(prompt: str, response: str, metadata: dict) -> float:
        return float(len(response))

    @register_reward("test_exact")
    def exact(prompt: str, response: str, metadata: dict) -> float:
        return response == metadata["answer"]  # a bool: accepted as 0/1

    return length, exact


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user package on sys.path with a reward function, a non-callable and a nested class."""
    pkg = tmp_path / "userpkg_rw"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(
        textwrap.dedent(
            """
            THRESHOLD = 3

            def contains_answer(prompt, response, metadata):
                return 1.0 if metadata["answer"] in response else -0.5

            class Scorers:
                @staticmethod
                def echo_prompt(prompt, response, metadata):
                    return float(prompt == response)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "userpkg_rw.scoring"
    for name in ("userpkg_rw.scoring", "userpkg_rw"):
        sys.modules.pop(name, None)


def test_registered_rewards_score_a_group_with_weights(registered):
    # length * 0.5 + exact * 2: "42" -> 1 + 2 = 3; "4" -> 0.5; "x42" -> 1.5
    rewards = score_group(
        ["test_length", "test_exact"], [0.5, 2.0], "Q?", ["42", "4", "x42"], {"answer": "42"}
    )
    assert rewards == [3.0, 0.5, 1.5]


def test_unweighted_scoring_sums_functions(registered):
    assert score_group(["test_length", "test_exact"], None, "Q", ["42"], {"answer": "42"}) == [3.0]


def test_user_function_is_imported_from_module_colon_function(user_module):
    fn = get_reward(f"{user_module}:contains_answer")
    assert fn("p", "the answer is 7", {"answer": "7"}) == 1.0
    nested = get_reward(f"{user_module}:Scorers.echo_prompt")
    assert score_group([nested], None, "same", ["same", "other"], {}) == [1.0, 0.0]
    rewards = score_group(
        [f"{user_module}:contains_answer"], [3.0], "p", ["7", "8"], {"answer": "7"}
    )
    assert rewards == [3.0, -1.5]


def test_user_spec_errors_say_what_is_wrong(user_module):
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg_xyz\.mod'"):
        get_reward("no_such_pkg_xyz.mod:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        get_reward(f"{user_module}:missing")
    with pytest.raises(ValueError, match="'THRESHOLD' is a int, not a function"):
        get_reward(f"{user_module}:THRESHOLD")
    with pytest.raises(ValueError, match=r"package\.module:function"):
        get_reward(f"{user_module}:")


def test_unknown_name_lists_registered_rewards_and_how_to_add_one(registered):
    assert reward_names() == ["test_exact", "test_length"]
    with pytest.raises(ValueError) as exc:
        get_reward("nope")
    message = str(exc.value)
    assert "unknown reward 'nope'" in message and "['test_exact', 'test_length']" in message
    assert "register_haystack_rewards()" in message and "'package.module:function'" in message


def test_register_reward_takes_the_function_or_decorates(registered):
    def constant(prompt, response, metadata):
        return 0.25

    assert register_reward("test_constant", constant) is constant
    assert get_reward("test_constant") is constant
    assert score_group(["test_constant", "test_length"], None, "p", ["abc"], {}) == [3.25]


def test_registering_a_different_function_under_a_taken_name_fails(registered):
    length, _ = registered
    assert register_reward("test_length")(length) is length  # same object: a reload, allowed
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_length")(lambda p, r, m: 0.0)
    with pytest.raises(ValueError, match="no ':'"):
        register_reward("a:b")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (float("nan"), "must be finite"),
        (math.inf, "must be finite"),
        (None, "must return a number"),
        ("1.0", "must return a number"),
    ],
)
def test_non_finite_or_non_numeric_reward_names_sample_and_function(value, why):
    def bad_on_second(prompt, response, metadata):
        return value if response == "b" else 1.0

    with pytest.raises(ValueError) as exc:
        score_group([bad_on_second], None, "p", ["a", "b"], {})
    message = str(exc.value)
    assert why in message and "sample 1" in message and "bad_on_second" in message, message


def test_reward_functions_get_their_own_copy_of_metadata():
    seen = []

    def mutating(prompt, response, metadata):
        seen.append(dict(metadata))
        metadata["dirty"] = True
        return 0.0

    meta = {"answer": "1"}
    score_group([mutating], None, "p", ["a", "b"], meta)
    assert seen == [{"answer": "1"}, {"answer": "1"}] and meta == {"answer": "1"}


def test_weight_count_must_match_specs(registered):
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        score_group(["test_length"], [1.0, 2.0], "p", ["a"], {})
    with pytest.raises(ValueError, match="at least one reward spec"):
        score_group([], None, "p", ["a"], {})
