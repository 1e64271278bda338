"""Prompt sources: the synthetic generator or a user's JSONL dataset, as `PromptExample`s."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from longstraw.data.haystack import generate_haystack_task
from longstraw.data.jsonl import read_prompt_dataset
from longstraw.data.trajectory import chat_prompt_ids, prompt_messages_ids, prompt_messages_text
from longstraw.schemas.run import HaystackDataConfig, JsonlDataConfig, RunConfig


@dataclass
class PromptExample:
    """One prompt of the training data."""

    prompt_id: str
    prompt_ids: torch.Tensor
    """[P] int64 token ids."""
    rewards: list[str]
    """Reward specs scoring this prompt's responses."""
    metadata: dict[str, Any] = field(default_factory=dict)
    text: str | None = None
    """The prompt as text when cheap to have (rewards receive it); None for id-only prompts."""
    chat: bool = False
    """The prompt is chat messages already rendered by the chat template (agent runs do not
    frame it again)."""

    @property
    def digest(self) -> str:
        """sha256 of the token ids: the key of this prompt's state in storage."""
        return prompt_digest(self.prompt_ids)


def prompt_digest(prompt_ids: torch.Tensor) -> str:
    data = prompt_ids.to(torch.int64).cpu().numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()


class HaystackPrompts:
    """Synthetic retrieval prompts: example i uses seed `task.seed + i % num_prompts`."""

    def __init__(self, config: HaystackDataConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer

    def __len__(self) -> int:
        """Distinct prompts (indices past them cycle)."""
        return self.config.num_prompts

    def __call__(self, index: int) -> PromptExample:
        slot = index % self.config.num_prompts
        task = self.config.task.model_copy(update={"seed": self.config.task.seed + slot})
        example = generate_haystack_task(task, self.tokenizer)
        text = example.prompt_text() if example.num_prompt_tokens <= 65_536 else None
        return PromptExample(
            prompt_id=f"haystack-{task.seed}",
            prompt_ids=torch.from_numpy(example.prompt_ids.astype(np.int64)),
            rewards=list(self.config.rewards),
            metadata=dict(example.metadata),
            text=text,
        )


class JsonlPrompts:
    """A user's JSONL prompt dataset (docs/data.md), read once and cycled through."""

    def __init__(self, config: JsonlDataConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.records = list(read_prompt_dataset(config.path))
        if not self.records:
            raise ValueError(f"{config.path} holds no prompts")
        self.imported = None
        if config.responses_path is not None:
            from longstraw.training.imported import ImportedResponses

            self.imported = ImportedResponses(
                config.responses_path, tokenizer, prompt_ids={r.id for r in self.records}
            )

    def __len__(self) -> int:
        """Records of the file (indices past them cycle)."""
        return len(self.records)

    def __call__(self, index: int) -> PromptExample:
        record = self.records[index % len(self.records)]
        ids = torch.tensor(record_prompt_ids(record, self.tokenizer), dtype=torch.int64)
        metadata = dict(record.metadata)
        if record.answer is not None:
            metadata.setdefault("answer", record.answer)
        return PromptExample(
            prompt_id=record.id,
            prompt_ids=ids,
            rewards=[record.reward] if record.reward else list(self.config.rewards),
            metadata=metadata,
            text=record.prompt
            if record.messages is None
            else record_chat_text(record, self.tokenizer),
            chat=record.messages is not None,
        )


def record_prompt_ids(record, tokenizer) -> list[int]:
    """[P] a JSONL record's prompt as the model sees it: its `prompt_ids`; its `messages`
    rendered by the tokenizer's chat template up to the assistant header; or its text tokenized
    by the run's tokenizer without special tokens."""
    if record.prompt_ids is not None:
        return list(record.prompt_ids)
    if record.messages is not None:
        return prompt_messages_ids(tokenizer, record.messages)
    return list(tokenizer.encode(record.prompt, add_special_tokens=False))


def record_chat_text(record, tokenizer) -> str:
    """A `messages` record's prompt as the text the chat template renders (what rewards get)."""
    return prompt_messages_text(tokenizer, record.messages)


def prompt_source(config: HaystackDataConfig | JsonlDataConfig, tokenizer):
    if isinstance(config, HaystackDataConfig):
        return HaystackPrompts(config, tokenizer)
    return JsonlPrompts(config, tokenizer)


class ChatPrompts:
    """Another source's prompts as the user message of a chat (agent runs): framed by the
    tokenizer's chat template, an optional system message first, the first assistant header
    last. The prompt's own ids are kept; its text (for rewards and environments) too. A prompt
    given as chat messages is already framed: it is used as it is (no system message added)."""

    imported = None

    def __init__(self, source, tokenizer, *, system: str | None):
        self.source = source
        self.tokenizer = tokenizer
        self.system = system

    def __call__(self, index: int) -> PromptExample:
        example = self.source(index)
        if example.chat:
            return example  # a `messages` record is its own chat, system message included
        ids = chat_prompt_ids(self.tokenizer, example.prompt_ids.tolist(), system=self.system)
        return replace(example, prompt_ids=torch.tensor(ids, dtype=torch.int64))


def run_prompt_source(config: RunConfig, tokenizer):
    """The prompts a run trains on: its data source, chat-framed when it runs an agent."""
    source = prompt_source(config.data, tokenizer)
    if config.agent is None:
        return source
    from longstraw.data.environments import system_prompt

    system = system_prompt(config.agent.environment) if config.agent.system_prompt else None
    return ChatPrompts(source, tokenizer, system=system)


def eval_prompt_source(config: RunConfig, tokenizer):
    """The held-out prompts of `eval.data` (None without an eval section)."""
    return None if config.eval is None else prompt_source(config.eval.data, tokenizer)
