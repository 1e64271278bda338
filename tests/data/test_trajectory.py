"""Trajectories from chat messages: the tiny checkpoints' chat template, the loss mask, the JSONL."""

from __future__ import annotations

import json

import pytest

from longstraw.data.jsonl import DataFormatError
from longstraw.data.trajectory import read_trajectory_file, tokenize_trajectory
from longstraw.errors import UserError

MESSAGES = [
    {"role": "system", "content": "You answer from the records."},
    {"role": "user", "content": "Records: abc = 12; xyz = 907. What is the value of key xyz?"},
    {"role": "assistant", "content": "lookup xyz"},
    {"role": "tool", "content": "xyz = 907"},
    {"role": "assistant", "content": "907"},
]


@pytest.fixture(scope="module")
def tokenizer(load_tokenizer):
    return load_tokenizer("llama")


def test_the_branch_is_the_template_rendering_after_the_prompt(tokenizer):
    tokens = tokenize_trajectory(tokenizer, MESSAGES)
    full = tokenizer.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)["input_ids"]
    assert tokens.prompt_ids + tokens.response_ids == list(full)
    assert len(tokens.loss_mask) == len(tokens.response_ids)
    assert tokenizer.decode(tokens.prompt_ids).endswith("<|im_start|>assistant\n")


def test_the_loss_mask_covers_the_assistant_turns_and_nothing_else(tokenizer):
    tokens = tokenize_trajectory(tokenizer, MESSAGES)
    trained = [t for t, m in zip(tokens.response_ids, tokens.loss_mask, strict=True) if m]
    given = [t for t, m in zip(tokens.response_ids, tokens.loss_mask, strict=True) if not m]
    assert tokenizer.decode(trained) == "lookup xyz<|im_end|>907<|im_end|>"
    assert (
        tokenizer.decode(given)
        == "\n<|im_start|>tool\nxyz = 907<|im_end|>\n<|im_start|>assistant\n\n"
    )


def test_a_tokenizer_without_a_chat_template_is_refused(tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        tokenize_trajectory(bare, MESSAGES)


def _write(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def _record(**overrides):
    record = {"prompt_id": "p0", "messages": MESSAGES, "reward": 1.0, "policy_version": 3}
    record.update(overrides)
    return record


def test_a_trajectory_file_reads_back_with_its_tokens(tmp_path, tokenizer):
    trained = sum(tokenize_trajectory(tokenizer, MESSAGES).loss_mask)
    path = _write(
        tmp_path / "t.jsonl",
        [_record(), "", _record(reward=0.0, sampler_logprobs=[-0.5] * trained)],
    )
    read = list(read_trajectory_file(path, tokenizer))
    assert [r.reward for r, _ in read] == [1.0, 0.0]
    assert read[1][0].sampler_logprobs == [-0.5] * trained
    assert sum(read[0][1].loss_mask) == trained


@pytest.mark.parametrize(
    ("bad", "line_and_field"),
    [
        (
            _record(messages=[{"role": "robot", "content": "hi"}, *MESSAGES[1:]]),
            ":2: field 'messages.0.role'",
        ),
        (_record(messages=MESSAGES[:2]), ":2: field 'messages'"),
        (_record(reward=float("nan")), ":2: field 'reward'"),
        (
            {k: v for k, v in _record().items() if k != "policy_version"},
            ":2: field 'policy_version'",
        ),
        (_record(sampler_logprobs=[-0.1, -0.2]), ":2: field 'sampler_logprobs'"),
        (_record(sampler_logprobs=[0.5]), ":2: field 'sampler_logprobs'"),
        (_record(extra=1), ":2: field 'extra'"),
    ],
)
def test_bad_trajectory_lines_are_named_by_line_and_field(tmp_path, tokenizer, bad, line_and_field):
    path = _write(tmp_path / "t.jsonl", [_record(), bad])
    with pytest.raises(DataFormatError) as err:
        list(read_trajectory_file(path, tokenizer))
    assert line_and_field in str(err.value)
