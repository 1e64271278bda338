"""Responses generated elsewhere: version checks and TRL's truncated importance weights."""

from __future__ import annotations

import json

import pytest
import torch

from longstraw.engine.prefill import prefill
from longstraw.engine.rollout import score_responses
from longstraw.grpo.losses import importance_weights
from longstraw.schemas.run import RunConfig
from longstraw.training.imported import ImportedResponses, imported_importance_weights
from longstraw.training.loop import train

SEED = 42


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture()
def dataset(tmp_path):
    torch.manual_seed(SEED)
    prompts = tmp_path / "prompts.jsonl"
    _write_jsonl(
        prompts, [{"id": "p0", "prompt_ids": torch.randint(1, 500, (37,)).tolist(), "answer": "A"}]
    )
    responses = tmp_path / "responses.jsonl"
    rows = [
        {
            "prompt_id": "p0",
            "response_ids": [5, 17, 9][:n],
            "sampler_logprobs": [-6.0, -6.5, -5.9][:n],
            "policy_version": 0,
        }
        for n in (1, 2, 3)
    ]
    _write_jsonl(responses, rows)
    return prompts, responses


def test_importance_weights_are_truncated_ratio():
    old = torch.tensor([-1.0, -2.0, -0.5])
    sampler = torch.tensor([-1.0, -1.0, -3.0])
    weights = importance_weights(old, sampler, cap=2.0)
    expected = torch.tensor([1.0, torch.exp(torch.tensor(-1.0)).item(), 2.0], dtype=torch.float64)
    torch.testing.assert_close(weights, expected)


def test_imported_weights_compare_sampler_with_trainer_replay(load_tiny, load_tokenizer, dataset):
    model = load_tiny("qwen3_5")
    prompts, responses_path = dataset
    prompt_ids = torch.tensor(json.loads(prompts.read_text())["prompt_ids"])
    state = prefill(model, prompt_ids, shard_tokens=10)
    tokenizer = load_tokenizer("qwen3_5")
    responses = ImportedResponses(str(responses_path), tokenizer).group("p0", policy_version=0)
    weights = imported_importance_weights(model, state, responses, temperature=1.0, cap=2.0)
    trainer = score_responses(model, state, [r.token_ids for r in responses])
    for w, t, r in zip(weights, trainer, responses, strict=True):
        expected = torch.exp(t.double() - torch.tensor(r.logprobs, dtype=torch.float64)).clamp(
            max=2.0
        )
        torch.testing.assert_close(w.double(), expected, rtol=1e-6, atol=1e-7)


def test_responses_of_another_policy_version_are_refused(dataset):
    _, responses_path = dataset
    imported = ImportedResponses(
        str(responses_path), tokenizer=None
    )  # ids given: no decoding needed
    with pytest.raises(ValueError, match=r"policy version 0.*at version 3"):
        imported.group("p0", policy_version=3)


def test_training_on_imported_responses_updates_the_policy(tmp_path, dataset, monkeypatch):
    prompts, responses_path = dataset
    # A user's reward module, importable as `user_rewards:length_reward`.
    (tmp_path / "user_rewards.py").write_text(
        "def length_reward(prompt, response, metadata):\n    return float(len(response))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = RunConfig.model_validate(
        {
            "run_id": "imported",
            "storage": {"root_uri": str(tmp_path / "root"), "persist_mode": "off"},
            "engine": {"shard_tokens": 16},
            "grpo": {
                "num_generations": 3,
                "max_completion_length": 3,
                "learning_rate": 1e-3,
                "loss_type": "grpo",
            },
            "data": {
                "type": "jsonl",
                "path": str(prompts),
                "rewards": ["user_rewards:length_reward"],
                "responses_path": str(responses_path),
            },
            "train": {"num_steps": 1, "groups_per_step": 1},
        }
    )
    ctx = train(config)
    (metrics,) = ctx.history
    # Rewards are the decoded lengths of 1-, 2- and 3-token responses: distinct, so the
    # advantages are non-zero and the update moves the weights.
    assert metrics.reward_std > 0
    assert metrics.grad_norm > 0
    assert ctx.policy_version == 1
