"""The users' JSONL formats: prompt datasets and imported responses (see docs/data.md).

Both are read as a stream, one line at a time (a line may hold a 2M-id prompt), and every
error names the file, the line number and the field, as a `DataFormatError` (a ValueError).
Blank lines are skipped.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Container, Iterable, Iterator
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

TokenId = Annotated[int, Field(ge=0)]

_LINE_1 = re.compile(r" at line 1 column")

# A sampler's log-probability is <= 0; allow fp rounding of an almost-certain token.
_MAX_LOGPROB = 1e-3


class DataFormatError(ValueError):
    """A record that does not follow the format, located by file, line and field."""

    def __init__(self, path: str, line: int, field: str | None, message: str):
        self.path, self.line, self.field = path, line, field
        where = f"{path}:{line}" + (f": field '{field}'" if field else "")
        super().__init__(f"{where}: {message}")


Role = Literal["system", "user", "assistant", "tool"]


class Message(BaseModel):
    """One chat message (of a prompt, or of a trajectory: `longstraw.data.trajectory`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    """system / user (the prompt), assistant (trained), tool (environment output, not trained)."""
    content: str
    """The message text."""


_PROMPT_FIELDS = ("prompt", "prompt_ids", "messages")


class PromptRecord(BaseModel):
    """One prompt of a user's dataset: one JSON object per line."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1)
    """Unique within the file; responses refer to it as `prompt_id`."""
    prompt: str | None = Field(default=None, min_length=1)
    """The prompt as text, tokenized by the run's tokenizer. Exactly one of
    `prompt`/`prompt_ids`/`messages`."""
    prompt_ids: list[TokenId] | None = Field(default=None, min_length=1)
    """The prompt as token ids of the run's tokenizer, used as they are (no special tokens
    added). Exactly one of `prompt`/`prompt_ids`/`messages`."""
    messages: list[Message] | None = Field(default=None, min_length=1)
    """The prompt as chat messages, rendered by the tokenizer's chat template with the
    assistant header the response follows (`add_generation_prompt`). Exactly one of
    `prompt`/`prompt_ids`/`messages`."""
    answer: str | None = None
    """The reference answer, for rewards that compare against one."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Anything the reward function needs (passed to it unchanged)."""
    reward: str | None = Field(default=None, min_length=1)
    """Name of a registered reward to score this prompt's responses; None: the run's default."""

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> PromptRecord:
        given = [f"'{f}'" for f in _PROMPT_FIELDS if getattr(self, f) is not None]
        if len(given) != 1:
            # With two given, the first is the field the error is reported at (`_field_of`).
            got = f"{' and '.join(given)} are given together: " if given else ""
            raise ValueError(
                f"{got}give exactly one of 'prompt' (text), 'prompt_ids' (token ids) or "
                f"'messages' (chat messages){'' if given else '; got neither'}"
            )
        if self.messages is not None and self.messages[-1].role == "assistant":
            raise ValueError(
                "'messages' ends with an assistant message; a prompt ends before the reply "
                "the policy samples: drop that message, or end with a user message"
            )
        return self


class ResponseRecord(BaseModel):
    """One response sampled elsewhere (vLLM, SGLang, ...) for a prompt of the dataset."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_id: str = Field(min_length=1)
    """The `id` of the prompt it answers; several responses per prompt form its group."""
    response: str | None = None
    """The response text. At least one of `response`/`response_ids`."""
    response_ids: list[TokenId] | None = None
    """The sampled token ids (without the prompt). Preferred: replay uses them as they are."""
    sampler_logprobs: list[float] | None = None
    """[len(response_ids)] the sampler's log-probability of each sampled token (for importance
    correction of sampler/trainer mismatch); needs `response_ids`."""
    policy_version: int = Field(ge=0)
    """Version of the policy checkpoint that sampled it (off-policy lag is measured from it)."""

    @model_validator(mode="after")
    def _consistent(self) -> ResponseRecord:
        if self.response is None and self.response_ids is None:
            raise ValueError("give 'response' (text) or 'response_ids' (or both)")
        if self.sampler_logprobs is not None:
            if self.response_ids is None:
                raise ValueError("'sampler_logprobs' needs 'response_ids' to align with")
            if len(self.sampler_logprobs) != len(self.response_ids):
                raise ValueError(
                    f"'sampler_logprobs' has {len(self.sampler_logprobs)} entries for "
                    f"{len(self.response_ids)} response_ids; give one per sampled token"
                )
            bad = [x for x in self.sampler_logprobs if not (math.isfinite(x) and x <= _MAX_LOGPROB)]
            if bad:
                raise ValueError(
                    f"'sampler_logprobs' must be finite log-probabilities <= 0; got {bad[0]!r}"
                )
        return self


_Record = TypeVar("_Record", PromptRecord, ResponseRecord)


def _field_of(error: dict[str, Any], model: type[BaseModel]) -> str | None:
    loc = [str(part) for part in error.get("loc", ())]
    if loc:
        return ".".join(loc)
    # A record-level check names its fields in quotes; the first one named is the field.
    message = error.get("msg", "")
    named = [(message.find(f"'{f}'"), f) for f in model.model_fields if f"'{f}'" in message]
    return min(named)[1] if named else None


def _describe(error: dict[str, Any], model: type[BaseModel]) -> str:
    kind = error.get("type")
    if kind == "json_invalid":
        detail = str(error.get("ctx", {}).get("error", error["msg"]))
        # The record is one line, so its "line 1" is the file's line already named.
        return f"invalid JSON ({_LINE_1.sub(' at column', detail)})"
    if kind in ("string_too_short", "too_short"):
        return "is empty; give it at least 1 character (text) or token id, or remove the line"
    if kind == "model_type":
        return "each line must be a JSON object"
    if kind == "extra_forbidden":
        loc = error.get("loc", ())
        close = difflib.get_close_matches(str(loc[-1]), model.model_fields, n=1) if loc else []
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"unknown field{hint}; allowed fields: {', '.join(model.model_fields)}"
    return error["msg"].removeprefix("Value error, ")


def _read_jsonl(path: str | os.PathLike, model: type[_Record]) -> Iterator[tuple[int, _Record]]:
    path_str = os.fspath(path)
    with open(path_str, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, model.model_validate_json(line.strip())
            except ValidationError as exc:
                error = exc.errors()[0]
                raise DataFormatError(
                    path_str, line_no, _field_of(error, model), _describe(error, model)
                ) from None


def read_prompt_dataset(path: str | os.PathLike) -> Iterator[PromptRecord]:
    """Stream the prompt records of a JSONL file, checking each line and that ids are unique."""
    for _, record in read_prompt_lines(path):
        yield record


def read_prompt_lines(path: str | os.PathLike) -> Iterator[tuple[int, PromptRecord]]:
    """(line number, record) of each prompt of a JSONL file, checked as `read_prompt_dataset`."""
    first_line: dict[str, int] = {}
    for line_no, record in _read_jsonl(path, PromptRecord):
        if record.id in first_line:
            raise DataFormatError(
                os.fspath(path),
                line_no,
                "id",
                f"duplicate id {record.id!r} (first on line {first_line[record.id]}); ids must be unique",
            )
        first_line[record.id] = line_no
        yield line_no, record


def read_response_file(
    path: str | os.PathLike, *, prompt_ids: Container[str] | None = None
) -> Iterator[ResponseRecord]:
    """Stream the response records of a JSONL file. With `prompt_ids` (the dataset's ids),
    a response to an unknown prompt is an error."""
    for line_no, record in _read_jsonl(path, ResponseRecord):
        if prompt_ids is not None and record.prompt_id not in prompt_ids:
            raise DataFormatError(
                os.fspath(path),
                line_no,
                "prompt_id",
                f"no prompt with id {record.prompt_id!r} in the dataset",
            )
        yield record


def write_jsonl(path: str | os.PathLike, records: Iterable[BaseModel]) -> int:
    """Write records one per line (None fields left out); returns how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(record.model_dump_json(exclude_none=True) + "\n")
            n += 1
    return n
