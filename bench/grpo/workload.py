"""What one benchmark configuration runs: the spec, and the deterministic batch built from it.

Every method sees the same prompt, responses and advantages for a given spec (seed 42): prompt
tokens uniform over the vocabulary (random weights do not care about content), responses of
unequal lengths around `response_tokens`, advantages of both signs summing to zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

Method = Literal[
    "longstraw-exact",
    "longstraw-detached",
    "full-sequence",
    "trl",
    "prefill",
    "hf-forward",
    "fidelity",
    "rollout",
    "trl-generate",
    "decode-steps",
]
METHODS: tuple[str, ...] = Method.__args__  # type: ignore[attr-defined]

# Responses vary by up to this many tokens either side of `response_tokens` (unequal lengths, as
# sampled responses are).
_LENGTH_SPREAD = 5


class BenchSpec(BaseModel):
    """One configuration: a method on a checkpoint at (P, G)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Method
    checkpoint: str
    """Hugging Face checkpoint directory (made by `init_model`)."""
    prompt_tokens: int = Field(ge=2)
    """P: prompt length in tokens."""
    group_size: int = Field(default=8, ge=1)
    """G: responses in the group."""
    response_tokens: int = Field(default=32, ge=1)
    """Mean response length; each response is within +-5 tokens of it."""
    shard_tokens: int = Field(default=2048, ge=1)
    """Prefill shard size of the LongStraw methods."""
    measured_sequences: int = Field(default=1, ge=1)
    """full-sequence / trl: sequences actually run; the step time is scaled to G linearly."""
    seed: int = 42
    decode_group_sizes: tuple[int, ...] = ()
    """decode-steps: the G values decoded (one after another) from the one prefilled state."""
    decode_repeats: int = Field(default=1, ge=1)
    """decode-steps: timed decodes per G (their median is the result)."""
    decode_reference_tokens: int = Field(default=0, ge=0)
    """decode-steps: also prefill the first this many prompt tokens and decode from that state too,
    alternated with the full one (the ratio of the two under the same load)."""


@dataclass(frozen=True)
class Batch:
    prompt_ids: torch.Tensor
    """[P] int64."""
    responses: list[torch.Tensor]
    """[G][R_i] int64, unequal lengths."""
    advantages: torch.Tensor
    """[G] fp32, zero mean."""


def response_lengths(spec: BenchSpec) -> list[int]:
    g = torch.Generator().manual_seed(spec.seed + 1)
    spread = min(_LENGTH_SPREAD, spec.response_tokens - 1)
    offsets = torch.randint(-spread, spread + 1, (spec.group_size,), generator=g)
    return [spec.response_tokens + int(o) for o in offsets]


def build_batch(spec: BenchSpec, vocab_size: int) -> Batch:
    g = torch.Generator().manual_seed(spec.seed)
    # Token 0 is the end-of-text token of the factory tokenizer: keep it out of the prompt.
    prompt = torch.randint(1, vocab_size, (spec.prompt_tokens,), generator=g)
    responses = [torch.randint(1, vocab_size, (n,), generator=g) for n in response_lengths(spec)]
    rewards = torch.randn(spec.group_size, generator=g)
    # A group of one has no relative advantage; give it 1 so its gradient is not zero.
    centred = rewards - rewards.mean()
    advantages = centred / (rewards.std() + 1e-4) if spec.group_size > 1 else torch.ones(1)
    return Batch(prompt, responses, advantages.float())


def ensure_checkpoint(root: str | Path, family: str = "qwen3_5", size: str = "small") -> Path:
    """The benchmark checkpoint under `root`, built once (seed 42) and reused."""
    from longstraw.models.factory import init_model

    path = Path(root) / f"{family}-{size}"
    if not (path / "config.json").exists():
        init_model(family, size, path, seed=42)
    return path
