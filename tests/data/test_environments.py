"""Agent environments and the chat framing of their turns.

The framing is checked against the chat template's own tokenization of the same conversation
(`tokenize_trajectory`): a rollout that appends `close_turn` + `observation` between sampled
turns builds exactly the ids and loss mask that rendering the finished conversation gives.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from longstraw.data.environments import (
    CalculatorEnvironment,
    KeyLookupEnvironment,
    environment_class,
    environment_factory,
    environment_names,
    evaluate_arithmetic,
    system_prompt,
)
from longstraw.data.haystack import generate_haystack_task
from longstraw.data.trajectory import ChatFraming, chat_prompt_ids, tokenize_trajectory
from longstraw.errors import UserError
from longstraw.schemas.data import HaystackTaskConfig


@pytest.fixture(scope="module")
def tokenizer(load_tokenizer):
    return load_tokenizer("qwen3_5")


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_rollout_framing_equals_the_templates_rendering_of_the_conversation(tokenizer):
    framing = ChatFraming.from_tokenizer(tokenizer)
    system, user = "Use the tool.", "Key 07 has value 8. What is the value of key 07?"
    turns, observations = ["lookup 07", "8"], ["Key 07 has value 8."]
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "content": observations[0]},
        {"role": "assistant", "content": turns[1]},
    ]
    expected = tokenize_trajectory(tokenizer, messages)
    (stop,) = framing.turn_stop_ids
    assert tokenizer.convert_ids_to_tokens(stop) == "<|im_end|>"
    # What the rollout builds: the framed prompt, each turn sampled up to its stop token, the
    # rest of the close and the observation given.
    prompt = chat_prompt_ids(tokenizer, _ids(tokenizer, user), system=system)
    ids, mask = [], []
    for i, turn in enumerate(turns):
        sampled = [*_ids(tokenizer, turn), stop]
        ids += sampled
        mask += [1] * len(sampled)
        if i < len(observations):
            given = framing.close_turn(stop) + framing.observation(observations[i])
            ids += given
            mask += [0] * len(given)
    # The rendering closes the last turn too; a rollout's branch ends at its stop token.
    tail = framing.close_turn(stop)
    assert prompt == expected.prompt_ids
    assert ids + tail == expected.response_ids
    assert mask + [0] * len(tail) == expected.loss_mask


def test_a_turn_cut_at_its_token_cap_is_closed_with_the_whole_end_marker(tokenizer):
    framing = ChatFraming.from_tokenizer(tokenizer)
    assert tokenizer.decode(framing.close_turn(None)) == "<|im_end|>\n"
    (stop,) = framing.turn_stop_ids
    assert tokenizer.decode(framing.close_turn(stop)) == "\n"


def test_a_tokenizer_without_a_chat_template_is_refused(tokenizer):
    bare = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    bare.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        ChatFraming.from_tokenizer(bare)
    with pytest.raises(UserError, match="no chat template"):
        chat_prompt_ids(bare, [5, 6])


def _haystack_metadata(tokenizer):
    task = HaystackTaskConfig.tiny(num_prompt_tokens=64, value_alphabet="0123456789")
    example = generate_haystack_task(task, tokenizer)
    return example, {**example.metadata, "prompt_text": example.prompt_text()}


def test_key_lookup_answers_from_the_prompts_records(tokenizer):
    example, metadata = _haystack_metadata(tokenizer)
    (asked,) = metadata["asked_keys"]
    env = KeyLookupEnvironment()
    env.reset(metadata)
    # Every record of the prompt text is in the table, distractors included.
    records = [line for line in example.prompt_text().splitlines() if line.startswith("Key ")]
    assert len(env.records) == len(records) >= 2
    distractor = next(k for k in env.records if k != asked)
    assert env.step(f"lookup {distractor}") == (env.records[distractor], False, None)
    assert env.step("lookup zz") == ("No record for key zz.", False, None)
    assert env.step(f"LOOKUP: {asked}") == (
        f"Key {asked} has value {metadata['answer']}.",
        False,
        None,
    )
    assert env.step(metadata["answer"]) == ("", True, 1.0)


def test_key_lookup_without_prompt_text_knows_the_needles(tokenizer):
    _, metadata = _haystack_metadata(tokenizer)
    del metadata["prompt_text"]
    env = KeyLookupEnvironment(reward="haystack_exact", queries_before_answer=1)
    env.reset(metadata)
    (asked,) = metadata["asked_keys"]
    # The first turn is a query whatever it says; its first word is the key.
    assert env.step(f"{asked} please") == (
        f"Key {asked} has value {metadata['answer']}.",
        False,
        None,
    )
    _, done, reward = env.step("no idea")
    assert done and reward == 0.0
    env.reset(metadata)
    assert env.step("")[0] == "No key given. Reply with 'lookup KEY'."
    assert env.step("7")[1:] == (True, float(metadata["answer"] == "7"))


def test_key_lookup_shaped_reward_gives_half_credit_in_the_value_alphabet(tokenizer):
    _, metadata = _haystack_metadata(tokenizer)
    env = KeyLookupEnvironment()
    env.reset(metadata)
    wrong = next(d for d in "0123456789" if d != metadata["answer"])
    assert env.step(wrong) == ("", True, 0.5)


@pytest.mark.parametrize(
    ("expression", "value"),
    [("12*(3+4)", 84), ("2**10 - 1", 1023), ("7 / 2", 3.5), ("-3 % 5", 2), ("7 // 2", 3)],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate_arithmetic(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "not an arithmetic expression"),
        ("x + 1", "not an arithmetic expression"),
        ("1 / 0", "division by zero"),
        ("2 ** 1000", "exponent 1000 above 64"),
        ("(-8) ** 0.5", "no finite real value"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 201, "longer than 200"),
    ],
)
def test_calculator_refuses_what_is_not_plain_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        evaluate_arithmetic(expression)


def test_calculator_environment_answers_and_scores():
    env = CalculatorEnvironment()
    env.reset({"answer": "84"})
    assert env.step("calc 12*(3+4)") == ("= 84", False, None)
    assert env.step("calc 1/0") == ("error: division by zero", False, None)
    assert env.step("calc 10/4") == ("= 2.5", False, None)
    assert env.step("The answer is 84.") == ("", True, 1.0)
    env.reset({"answer": "84"})
    assert env.step("83") == ("", True, 0.0)
    assert env.step("no number") == ("", True, 0.0)
    with pytest.raises(ValueError, match="is not a number"):
        env.reset({"answer": "eighty"})


def test_environments_by_name_and_by_import_path(tmp_path, monkeypatch):
    assert {"key_lookup", "calculator"} <= set(environment_names())
    assert environment_class("calculator") is CalculatorEnvironment
    assert "lookup" in system_prompt("key_lookup")
    (tmp_path / "my_envs.py").write_text(
        textwrap.dedent(
            """
            class Echo:
                def __init__(self, suffix="!"):
                    self.suffix = suffix
                def reset(self, metadata):
                    pass
                def step(self, text):
                    return text + self.suffix, False, None

            class NoStep:
                def reset(self, metadata):
                    pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    make = environment_factory("my_envs:Echo", {"suffix": "?"})
    first, second = make(), make()
    assert first is not second and first.step("hi") == ("hi?", False, None)
    assert system_prompt("my_envs:Echo") is None
    with pytest.raises(UserError, match=r"does not accept agent\.environment_args"):
        environment_factory("my_envs:Echo", {"colour": "red"})
    with pytest.raises(UserError, match="lacks step"):
        environment_class("my_envs:NoStep")
    with pytest.raises(UserError, match="has no 'Missing'"):
        environment_class("my_envs:Missing")
    with pytest.raises(UserError, match="cannot import 'no_such_module_xyz'"):
        environment_class("no_such_module_xyz:Env")
    with pytest.raises(UserError, match="unknown environment 'kv'"):
        environment_class("kv")
    sys.modules.pop("my_envs", None)
