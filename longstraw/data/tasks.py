"""Synthetic task examples and the registry of task generators.

A task generator turns a task config (a frozen pydantic model with a `type` field) and a
tokenizer into a `TaskExample`: the prompt as token ids (the primary output: a 2M-token prompt
is one int32 array, never millions of Python objects), the expected answer, and JSON-safe
metadata that the rewards read. Generators register under their config's `type`:

    @register_task("haystack")
    def generate_haystack_task(config, tokenizer) -> TaskExample: ...

and `generate_task(config, tokenizer)` dispatches on `config.type`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class TaskConfig(Protocol):
    """Any task config: a pydantic model whose `type` names its generator."""

    type: str


@dataclass(frozen=True, eq=False)
class TaskExample:
    """One generated prompt with its answer."""

    prompt_ids: np.ndarray
    """[P] int32 token ids of the whole prompt (haystack + question)."""
    answer: str
    """The expected answer as text (what the rewards compare against)."""
    answer_ids: np.ndarray
    """[A] int32 token ids of the expected completion (`metadata["answer_completion"]`)."""
    metadata: dict[str, Any]
    """JSON-safe facts about the example (variant, seed, needles and their token positions, ...)."""
    piece_texts: Sequence[str] = field(repr=False)
    """The distinct text pieces the prompt was built from (each tokenized once)."""
    piece_sequence: np.ndarray = field(repr=False)
    """[N] int32 indices into `piece_texts`; their concatenation is the prompt text."""

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt_ids.shape[0])

    def prompt_text(self) -> str:
        """The prompt as text, joined from its pieces (no tokenizer needed).

        Built only when asked: a 2M-token prompt is ~8 MB of text.
        """
        texts = self.piece_texts
        return "".join(texts[i] for i in self.piece_sequence.tolist())

    def to_prompt_record(self, record_id: str, *, reward: str | None = None, as_ids: bool = True):
        """This example as a `PromptRecord` of the users' JSONL format.

        `as_ids=True` stores `prompt_ids` (exactly what the model sees); `False` stores the text.
        """
        from longstraw.data.jsonl import PromptRecord

        prompt: dict[str, Any] = (
            {"prompt_ids": self.prompt_ids.tolist()} if as_ids else {"prompt": self.prompt_text()}
        )
        return PromptRecord(
            id=record_id, answer=self.answer, metadata=self.metadata, reward=reward, **prompt
        )


TaskGenerator = Callable[[Any, Any], TaskExample]

_TASK_GENERATORS: dict[str, TaskGenerator] = {}


def register_task(name: str) -> Callable[[TaskGenerator], TaskGenerator]:
    """Register a generator under `name` (the `type` of the configs it accepts)."""

    def decorator(fn: TaskGenerator) -> TaskGenerator:
        if name in _TASK_GENERATORS and _TASK_GENERATORS[name] is not fn:
            raise ValueError(f"task generator {name!r} is already registered; pick another name")
        _TASK_GENERATORS[name] = fn
        return fn

    return decorator


# The built-in generators register as the package imports them (`longstraw.data`'s __init__
# imports `haystack` before anything reaches this module's functions).


def task_names() -> list[str]:
    """Names of the registered task generators."""
    return sorted(_TASK_GENERATORS)


def get_task_generator(name: str) -> TaskGenerator:
    if name not in _TASK_GENERATORS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(_TASK_GENERATORS)}")
    return _TASK_GENERATORS[name]


def generate_task(config: TaskConfig, tokenizer: Any) -> TaskExample:
    """Generate one example with the generator registered under `config.type`."""
    return get_task_generator(config.type)(config, tokenizer)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without special tokens (no BOS/EOS), from any tokenizer-like object.

    Accepts a `tokenizers.Tokenizer`, a transformers tokenizer, or anything whose
    `encode(text)` returns a list of ints or an object with `.ids`.
    """
    return encode_texts(tokenizer, [text])[0]


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """`encode_text` for many texts, batched when the tokenizer has a fast batch path."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers' fast tokenizers
    if backend is None and hasattr(tokenizer, "encode_batch"):
        backend = tokenizer  # a tokenizers.Tokenizer itself
    if backend is not None and hasattr(backend, "encode_batch"):
        return [list(e.ids) for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    out = []
    for text in texts:
        try:
            ids = tokenizer.encode(text, add_special_tokens=False)
        except TypeError:  # a plain encode(text) without that keyword
            ids = tokenizer.encode(text)
        out.append(list(getattr(ids, "ids", ids)))
    return out


def write_task_dataset(
    path: str | os.PathLike, examples: Iterable[tuple[str, TaskExample]], *, reward: str | None
) -> int:
    """Write `(id, example)` pairs as a JSONL prompt dataset (prompt_ids); returns the count."""
    from longstraw.data.jsonl import write_jsonl

    return write_jsonl(path, (ex.to_prompt_record(i, reward=reward) for i, ex in examples))
