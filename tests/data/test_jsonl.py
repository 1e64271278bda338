"""Users' JSONL prompt datasets and imported responses: streaming reads, and errors that name
the file, the line and the field."""

from __future__ import annotations

import json

import pytest

from longstraw.data.jsonl import (
    DataFormatError,
    PromptRecord,
    ResponseRecord,
    read_prompt_dataset,
    read_response_file,
    write_jsonl,
)


def write_lines(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD_PROMPTS = [
    json.dumps({"id": "p0", "prompt": "What is 2+2?", "answer": "4", "reward": "math_exact"}),
    "",
    json.dumps({"id": "p1", "prompt_ids": [5, 17, 3], "metadata": {"values": ["7"]}}),
]


def test_prompt_dataset_is_read_with_every_field(tmp_path):
    path = write_lines(tmp_path / "prompts.jsonl", GOOD_PROMPTS)
    records = list(read_prompt_dataset(path))
    assert [r.id for r in records] == ["p0", "p1"]
    assert records[0].prompt == "What is 2+2?" and records[0].prompt_ids is None
    assert records[0].answer == "4" and records[0].reward == "math_exact"
    assert records[1].prompt_ids == [5, 17, 3] and records[1].metadata == {"values": ["7"]}
    assert records[1].reward is None and records[1].answer is None


def test_written_records_read_back_equal(tmp_path):
    records = [
        PromptRecord(id="a", prompt="hello", metadata={"x": [1, 2]}),
        PromptRecord(id="b", prompt_ids=[1, 2, 3], answer="z", reward="haystack_exact"),
    ]
    path = tmp_path / "out.jsonl"
    assert write_jsonl(path, records) == 2
    assert list(read_prompt_dataset(path)) == records


def bad_prompt_error(tmp_path, bad_line: str, line_no: int = 3) -> DataFormatError:
    lines = [*GOOD_PROMPTS[:2], bad_line]
    assert len(lines) == line_no
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataFormatError) as info:
        list(read_prompt_dataset(path))
    error = info.value
    assert error.path == str(path) and error.line == line_no
    assert str(error).startswith(f"{path}:{line_no}")
    return error


@pytest.mark.parametrize(
    ("bad_line", "field", "message"),
    [
        ('{"id": "p2", "prompt": "unterminated}', None, "invalid JSON"),
        ('["not", "an", "object"]', None, "JSON object"),
        ('{"id": "p2", "prompt": "x", "prompt_ids": [1]}', "prompt", "exactly one of 'prompt'"),
        ('{"id": "p2"}', "prompt", "got neither"),
        (
            '{"id": "p2", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}',
            "prompt",
            "'prompt' and 'messages' are given together: give exactly one of",
        ),
        (
            '{"id": "p2", "prompt_ids": [1], "messages": [{"role": "user", "content": "x"}]}',
            "prompt_ids",
            "'prompt_ids' and 'messages' are given together",
        ),
        ('{"id": "p2", "messages": []}', "messages", "at least 1"),
        (
            '{"id": "p2", "messages": [{"role": "bot", "content": "x"}]}',
            "messages.0.role",
            "'user'",
        ),
        ('{"id": "p2", "messages": [{"role": "user"}]}', "messages.0.content", "Field required"),
        (
            '{"id": "p2", "messages": [{"role": "user", "content": "q"}, '
            '{"role": "assistant", "content": "a"}]}',
            "messages",
            "ends with an assistant message",
        ),
        ('{"id": "p2", "prompt_ids": [1, -4]}', "prompt_ids.1", "greater than or equal to 0"),
        ('{"id": "p2", "prompt_ids": []}', "prompt_ids", "at least 1"),
        ('{"id": "p2", "prompt": ""}', "prompt", "at least 1"),
        ('{"prompt": "x"}', "id", "Field required"),
        ('{"id": "p2", "prompt": "x", "promt": "y"}', "promt", "allowed fields: id, prompt"),
        ('{"id": "p2", "prompt": "x", "metadata": [1]}', "metadata", "should be an object"),
        ('{"id": "p0", "prompt": "again"}', "id", "duplicate id 'p0' (first on line 1)"),
    ],
)
def test_bad_prompt_line_names_line_and_field(tmp_path, bad_line, field, message):
    error = bad_prompt_error(tmp_path, bad_line)
    assert error.field == field, str(error)
    assert message in str(error), str(error)
    if field is not None:
        assert f"field '{field}'" in str(error)


def test_records_before_a_bad_line_stream_out_first(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [*GOOD_PROMPTS, "{oops"])
    stream = read_prompt_dataset(path)
    assert next(stream).id == "p0"
    assert next(stream).id == "p1"
    with pytest.raises(DataFormatError, match=":4: invalid JSON"):
        next(stream)


def test_invalid_utf8_is_reported_with_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "\xff\xfe"}\n')
    with pytest.raises(DataFormatError, match=":2: invalid JSON"):
        list(read_prompt_dataset(path))


GOOD_RESPONSES = [
    json.dumps({"prompt_id": "p0", "response": " 4", "policy_version": 3}),
    json.dumps(
        {
            "prompt_id": "p0",
            "response": " 5",
            "response_ids": [17, 2],
            "sampler_logprobs": [-0.25, -1.5],
            "policy_version": 3,
        }
    ),
    json.dumps({"prompt_id": "p1", "response_ids": [9], "policy_version": 2}),
]


def test_response_file_is_read_with_every_field(tmp_path):
    path = write_lines(tmp_path / "responses.jsonl", GOOD_RESPONSES)
    records = list(read_response_file(path, prompt_ids={"p0", "p1"}))
    assert [r.prompt_id for r in records] == ["p0", "p0", "p1"]
    assert records[1].response_ids == [17, 2] and records[1].sampler_logprobs == [-0.25, -1.5]
    assert records[2].response is None and records[2].policy_version == 2
    assert list(read_response_file(path)) == records
    out = tmp_path / "copy.jsonl"
    write_jsonl(out, records)
    assert list(read_response_file(out)) == records


@pytest.mark.parametrize(
    ("bad", "field", "message"),
    [
        ({"prompt_id": "p0", "policy_version": 1}, "response", "give 'response'"),
        ({"prompt_id": "p0", "response": "x"}, "policy_version", "Field required"),
        (
            {"prompt_id": "p0", "response": "x", "policy_version": -1},
            "policy_version",
            "greater than or equal to 0",
        ),
        (
            {"prompt_id": "p0", "response": "x", "sampler_logprobs": [-1.0], "policy_version": 0},
            "sampler_logprobs",
            "needs 'response_ids'",
        ),
        (
            {
                "prompt_id": "p0",
                "response_ids": [1, 2, 3],
                "sampler_logprobs": [-1.0, -2.0],
                "policy_version": 0,
            },
            "sampler_logprobs",
            "2 entries for 3 response_ids",
        ),
        (
            {
                "prompt_id": "p0",
                "response_ids": [1],
                "sampler_logprobs": [0.5],
                "policy_version": 0,
            },
            "sampler_logprobs",
            "<= 0",
        ),
        ({"prompt_id": "nope", "response": "x", "policy_version": 0}, "prompt_id", "no prompt"),
    ],
)
def test_bad_response_line_names_line_and_field(tmp_path, bad, field, message):
    path = write_lines(tmp_path / "r.jsonl", [*GOOD_RESPONSES, json.dumps(bad)])
    with pytest.raises(DataFormatError) as info:
        list(read_response_file(path, prompt_ids={"p0", "p1"}))
    error = info.value
    assert error.line == 4 and error.field == field, str(error)
    assert f"{path}:4: field '{field}'" in str(error)
    assert message in str(error), str(error)


def test_non_finite_logprob_is_refused():
    with pytest.raises(ValueError, match="finite"):
        ResponseRecord(
            prompt_id="p", response_ids=[1], sampler_logprobs=[float("nan")], policy_version=0
        )
