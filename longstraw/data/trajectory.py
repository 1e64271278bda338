"""Agent trajectories as data: chat messages -> (prompt ids, branch ids, loss mask).

A trajectory starts from one long prompt (the messages before the first assistant turn) and
goes on with assistant turns (trained) interleaved with tool or environment outputs (given, not
trained). It is tokenized with the tokenizer's own chat template (`apply_chat_template`); the
template marks the assistant's tokens with `{% generation %}` (transformers'
`return_assistant_tokens_mask`), which gives the loss mask: 1 on what the assistant produced,
0 on role headers, tool output and other turns. The tiny checkpoints ship such a template
(`longstraw.models.tokenizer.CHAT_TEMPLATE`).

JSONL for trajectories generated elsewhere (docs/data.md): one `TrajectoryRecord` per line;
every error names the file, the line and the field (`DataFormatError`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Message lives with the prompt records (a prompt may be chat messages too); trajectories reuse it.
from longstraw.data.jsonl import _MAX_LOGPROB, DataFormatError, Message, _read_jsonl
from longstraw.errors import UserError


class TrajectoryRecord(BaseModel):
    """One trajectory sampled elsewhere: one JSON object per line of a trajectory file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_id: str = Field(min_length=1)
    """Trajectories with the same prompt_id form one GRPO group (their prompts must agree)."""
    messages: list[Message] = Field(min_length=2)
    """The conversation: the prompt's messages, then assistant turns and tool outputs."""
    reward: float
    """The trajectory's reward (finite)."""
    sampler_logprobs: list[float] | None = None
    """The sampler's log-probability of each assistant token (loss-mask 1), in order; None:
    no importance correction."""
    policy_version: int = Field(ge=0)
    """Version of the policy checkpoint that sampled it."""

    @field_validator("reward")
    @classmethod
    def _finite(cls, reward: float) -> float:
        if not math.isfinite(reward):
            raise ValueError(f"reward must be finite, got {reward!r}")
        return reward

    @model_validator(mode="after")
    def _shape(self) -> TrajectoryRecord:
        roles = [m.role for m in self.messages]
        if "assistant" not in roles:
            raise ValueError("'messages' has no assistant turn; a trajectory needs at least one")
        if roles[0] == "assistant":
            raise ValueError("'messages' starts with an assistant turn; put the prompt first")
        if self.sampler_logprobs is not None:
            bad = [x for x in self.sampler_logprobs if not (math.isfinite(x) and x <= _MAX_LOGPROB)]
            if bad:
                raise ValueError(
                    f"'sampler_logprobs' must be finite log-probabilities <= 0; got {bad[0]!r}"
                )
        return self


@dataclass(frozen=True)
class TokenizedTrajectory:
    """A trajectory as the engine replays it."""

    prompt_ids: list[int]
    """[P] the messages before the first assistant turn, with that turn's header."""
    response_ids: list[int]
    """[R] everything after: assistant turns, tool outputs, their headers."""
    loss_mask: list[int]
    """[R] 1 on the assistant's own tokens (trained), 0 elsewhere."""


def _turns(messages: Sequence[Message | dict]) -> list[dict]:
    return [m.model_dump() if isinstance(m, Message) else dict(m) for m in messages]


def prompt_messages_ids(tokenizer, messages: Sequence[Message | dict]) -> list[int]:
    """[P] the prompt messages as the model sees them: rendered by the tokenizer's chat
    template, followed by the header of the assistant turn that the response fills
    (`add_generation_prompt`). A prompt dataset's `messages` and a trajectory's prompt part."""
    _require_template(tokenizer)
    rendered = tokenizer.apply_chat_template(
        _turns(messages), tokenize=True, return_dict=True, add_generation_prompt=True
    )
    return list(rendered["input_ids"])


def prompt_messages_text(tokenizer, messages: Sequence[Message | dict]) -> str:
    """The text `prompt_messages_ids` encodes (what rewards and environments get as the prompt)."""
    return _render(tokenizer, _turns(messages), add_generation_prompt=True)


def tokenize_trajectory(tokenizer, messages: Sequence[Message | dict]) -> TokenizedTrajectory:
    """Split a conversation into prompt, branch and loss mask with the tokenizer's chat template."""
    turns = _turns(messages)
    _require_template(tokenizer)
    first = next((i for i, t in enumerate(turns) if t["role"] == "assistant"), None)
    if first is None or first == 0:
        raise UserError("a trajectory needs prompt messages followed by an assistant turn")
    full = tokenizer.apply_chat_template(
        turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    prompt = prompt_messages_ids(tokenizer, turns[:first])
    ids, mask = list(full["input_ids"]), list(full["assistant_masks"])
    if ids[: len(prompt)] != list(prompt):
        raise UserError(
            "the chat template renders the prompt differently inside the conversation than on "
            "its own (with add_generation_prompt); use a template whose turns concatenate"
        )
    if any(mask[: len(prompt)]) or not any(mask):
        raise UserError(
            "the chat template marks no assistant tokens after the prompt; wrap assistant "
            "content in {% generation %} ... {% endgeneration %}"
        )
    return TokenizedTrajectory(list(prompt), ids[len(prompt) :], mask[len(prompt) :])


def read_trajectory_file(
    path: str | os.PathLike, tokenizer
) -> Iterator[tuple[TrajectoryRecord, TokenizedTrajectory]]:
    """Stream a trajectory JSONL file: each record checked, tokenized, and its
    `sampler_logprobs` checked against its assistant-token count."""
    path_str = os.fspath(path)
    for line_no, record in _read_jsonl(path_str, TrajectoryRecord):
        try:
            tokens = tokenize_trajectory(tokenizer, record.messages)
        except UserError as exc:
            raise DataFormatError(path_str, line_no, "messages", str(exc)) from None
        trained = sum(tokens.loss_mask)
        if record.sampler_logprobs is not None and len(record.sampler_logprobs) != trained:
            raise DataFormatError(
                path_str,
                line_no,
                "sampler_logprobs",
                f"has {len(record.sampler_logprobs)} entries for {trained} assistant tokens; "
                "give one per assistant token, in order",
            )
        yield record, tokens


_SENTINEL = "\x00LONGSTRAW-{}\x00"


def _require_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "the tokenizer has no chat template; use a checkpoint whose tokenizer has one "
            "(with {% generation %} around assistant text), or set tokenizer.chat_template"
        )


def _render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
    _require_template(tokenizer)
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _split_at(text: str, sentinel: str, what: str) -> tuple[str, str]:
    if text.count(sentinel) != 1:
        raise UserError(f"the chat template does not render a {what} message's content verbatim")
    head, tail = text.split(sentinel)
    return head, tail


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


@dataclass(frozen=True)
class ChatFraming:
    """The chat template's tokens around agent turns, read off the template itself.

    Rendering `[user, assistant "A"]` and then the same with an observation message added (and
    the next assistant header) gives: the tokens that close an assistant turn (`close_ids`,
    e.g. `<|im_end|>` `\\n` in ChatML), and the text before and after an observation's content.
    The first close token, when the tokenizer has it as one special token, is what ends a
    sampled turn (`turn_stop_ids`); the model samples it, so it is trained.
    """

    close_ids: tuple[int, ...]
    observation_head: str
    observation_tail: str
    tokenizer: object

    @classmethod
    def from_tokenizer(cls, tokenizer, *, observation_role: str = "tool") -> ChatFraming:
        user = {"role": "user", "content": "Q"}
        turn = {"role": "assistant", "content": _SENTINEL.format("A")}
        base = _render(tokenizer, [user, turn])
        _, close = _split_at(base, turn["content"], "assistant")
        tool = {"role": observation_role, "content": _SENTINEL.format("O")}
        full = _render(tokenizer, [user, turn, tool], add_generation_prompt=True)
        if not full.startswith(base):
            raise UserError(
                f"the chat template renders the conversation differently once a "
                f"{observation_role!r} message follows; use a template whose turns concatenate"
            )
        head, tail = _split_at(full[len(base) :], tool["content"], observation_role)
        return cls(tuple(_ids(tokenizer, close)), head, tail, tokenizer)

    @property
    def turn_stop_ids(self) -> tuple[int, ...]:
        special = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
        return (self.close_ids[0],) if self.close_ids and self.close_ids[0] in special else ()

    def close_turn(self, stop_id: int | None) -> list[int]:
        if self.close_ids and stop_id == self.close_ids[0]:
            return list(self.close_ids[1:])
        return list(self.close_ids)

    def observation(self, text: str) -> list[int]:
        return _ids(self.tokenizer, self.observation_head + text + self.observation_tail)


def chat_prompt_ids(
    tokenizer, prompt_ids: Sequence[int], *, system: str | None = None
) -> list[int]:
    """[P'] `prompt_ids` as the content of a user message, framed by the chat template (an
    optional system message first) and followed by the first assistant header.

    The given ids are kept as they are (a long prompt is never re-tokenized); only the framing
    around them is tokenized.
    """
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": _SENTINEL.format("U")})
    text = _render(tokenizer, messages, add_generation_prompt=True)
    head, tail = _split_at(text, messages[-1]["content"], "user")
    return _ids(tokenizer, head) + list(prompt_ids) + _ids(tokenizer, tail)
