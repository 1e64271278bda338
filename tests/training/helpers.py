"""Run configs shared by the training tests: the tiny Qwen3.5 checkpoint on the synthetic task."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig

# Fields of StepMetrics that depend on the machine, not on the algorithm.
MACHINE_FIELDS = {"seconds", "step_seconds", "peak_rss_bytes"}


def small_haystack_task(**overrides) -> dict:
    """The training tests' haystack task: 64 prompt tokens, two-token keys, one-digit values,
    no header; `overrides` replace fields."""
    return {
        "num_prompt_tokens": 64,
        "key_length": 2,
        "value_length": 1,
        "value_alphabet": "0123456789",
        "num_distinct_distractors": 8,
        "distractor_fraction": 1.0,
        "include_header": False,
        **overrides,
    }


def run_config(
    root: Path,
    checkpoint: Path,
    *,
    run_id: str = "test",
    num_steps: int = 3,
    grpo: dict | None = None,
    task: dict | None = None,
    data: dict | None = None,
    train: dict | None = None,
    engine: dict | None = None,
    persist_mode: str = "off",
) -> RunConfig:
    """A small exact-mode run: 63 state tokens in 3 shards of 23 (the last one short)."""
    return RunConfig.model_validate(
        {
            "run_id": run_id,
            "model": {"checkpoint": str(checkpoint)},
            "engine": {"shard_tokens": 23, "prompt_grad": "exact", **(engine or {})},
            "grpo": {
                "num_generations": 4,
                "max_completion_length": 2,
                "learning_rate": 1e-2,
                "loss_type": "grpo",
                **(grpo or {}),
            },
            "data": {
                "type": "haystack",
                "rewards": ["haystack_shaped"],
                "num_prompts": 8,
                "task": small_haystack_task(**(task or {})),
                **(data or {}),
            },
            "train": {
                "num_steps": num_steps,
                "groups_per_step": 2,
                "checkpoint_every": 1,
                "seed": 42,
                **(train or {}),
            },
            "storage": {"root_uri": str(root), "persist_mode": persist_mode},
        }
    )


def algorithm_fields(metrics: StepMetrics) -> dict:
    """A step's metrics without wall-clock and memory numbers."""
    return metrics.model_dump(exclude=MACHINE_FIELDS)


_REWARD_CALLS = itertools.count()
"""Reward calls made in this process while a delay is set (rewards run on rank 0 only)."""


def checksum_reward(prompt: str, response: str, metadata: dict) -> float:
    """A reward that differs between responses (so advantages and gradients are non-zero),
    importable by a fresh process as `tests.training.helpers:checksum_reward`.

    `LONGSTRAW_TEST_REWARD_DELAY_S` makes each call slow without changing its value, so a crash
    test can hold a step open after its prompt state is committed;
    `LONGSTRAW_TEST_REWARD_DELAY_AFTER_CALLS` (default 0) leaves the process's first calls (the
    steps before the one the test holds open) undelayed."""
    delay = float(os.environ.get("LONGSTRAW_TEST_REWARD_DELAY_S", "0"))
    if delay and next(_REWARD_CALLS) >= int(
        os.environ.get("LONGSTRAW_TEST_REWARD_DELAY_AFTER_CALLS", "0")
    ):
        time.sleep(delay)
    return (sum(response.encode()) % 11) / 10.0
