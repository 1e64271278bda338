"""One GRPO step's stages: the reference model (beta > 0) and more than one update per rollout.

Legend: P prompt tokens, R response tokens, V vocab.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import longstraw.training.persisted_prefill as persisted_prefill_module
from longstraw.engine.prefill import prefill
from longstraw.engine.replay import token_logprobs
from longstraw.training import held, stages
from longstraw.training import stages as step_module
from longstraw.training.loop import train
from longstraw.training.step import run_step
from tests.training.helpers import run_config

# Replay over a prefix state vs one full forward: fp32 reorderings (STYLE.md).
LOGP_ATOL = 1e-5
NUM_SHARDS = 3  # 63 state tokens in shards of 23
CHECKSUM_REWARD = "tests.training.helpers:checksum_reward"


@pytest.fixture
def count_prefills(monkeypatch):
    """Counter of prefill shard calls by model id (every persisted prefill goes through it)."""
    calls: Counter = Counter()
    real = persisted_prefill_module.prefill

    def counting(model, *args, **kwargs):
        calls[id(model)] += 1
        return real(model, *args, **kwargs)

    monkeypatch.setattr(persisted_prefill_module, "prefill", counting)
    return calls


@pytest.mark.parametrize("persist_mode", ["off", "synchronous"])
def test_reference_state_is_prefilled_once_per_prompt(
    tmp_path, checkpoint_dir, count_prefills, persist_mode
):
    config = run_config(
        tmp_path,
        checkpoint_dir("qwen3_5"),
        num_steps=3,
        grpo={"beta": 0.04},
        # Two prompts, seen at every step; a reward that varies, so every step moves the policy.
        data={"num_prompts": 2, "rewards": [CHECKSUM_REWARD]},
        persist_mode=persist_mode,
    )
    per_step = []

    def reference_prefills(metrics) -> None:
        per_step.append(count_prefills[id(held.held_policy(config.run_id).reference_model)])

    ctx = train(config, on_step=reference_prefills)
    # Step 0 prefills both prompts (3 shards each); steps 1 and 2 reuse those states.
    assert per_step == [2 * NUM_SHARDS] * 3
    # The policy changes every step, so its states are recomputed every step.
    assert count_prefills[id(ctx.context().model)] == 3 * 2 * NUM_SHARDS
    kls = [m.kl for m in ctx.history]
    # At step 0 the policy is the reference: the same weights on the same state, bitwise.
    assert kls[0] == 0.0 and all(k > 0 for k in kls[1:]), kls


def test_reference_logprobs_match_the_reference_full_forward(tmp_path, checkpoint_dir):
    config = run_config(
        tmp_path, checkpoint_dir("qwen3_5"), grpo={"beta": 0.04, "temperature": 0.8}
    )
    policy = stages.open_run(config)
    ctx = held.policy(config, policy)
    assert ctx.reference_model is not ctx.model
    # Move the policy so that policy and reference differ; the reference must not follow.
    with torch.no_grad():
        for p in ctx.model.parameters():
            p.add_(0.01)
    prompt = stages.plan_step(config, policy)[0]
    stages.prefill_prompt(config, policy, prompt)
    rollout = stages.rollout_group(config, policy, prompt)
    scores = stages.score_group(config, policy, rollout, "reference")
    refs = [torch.tensor(r) for r in json.loads(Path(scores.uri[7:]).read_text())]
    record = stages.rollout_record(rollout)
    prompt_P = ctx.source(prompt.index).prompt_ids
    for ids_R, sampler_R, ref_R in zip(
        record.response_ids, record.sampler_logprobs, refs, strict=True
    ):
        response = SimpleNamespace(token_ids=ids_R, logprobs=sampler_R)
        ids = torch.cat([prompt_P, torch.tensor(response.token_ids)])
        with torch.no_grad():
            logits = ctx.reference_model(input_ids=ids.unsqueeze(0)).logits  # [1, P+R, V]
        prompt_len, length = prompt_P.numel(), len(response.token_ids)
        expected_R = token_logprobs(
            logits[:, prompt_len - 1 : prompt_len - 1 + length],
            torch.tensor(response.token_ids).unsqueeze(0),
            0.8,
        )[0]
        diff = float((ref_R - expected_R).abs().max())
        assert diff <= LOGP_ATOL, f"max_diff={diff:.3e}"
        # The policy (moved) gives other log-probs: the reference really is a separate model.
        assert not torch.allclose(torch.tensor(response.logprobs), ref_R, atol=1e-3)


def test_second_iteration_uses_no_grad_old_logprobs_and_a_recomputed_state(
    tmp_path, checkpoint_dir, monkeypatch
):
    config = run_config(
        tmp_path,
        checkpoint_dir("qwen3_5"),
        grpo={"num_iterations": 2},
        data={"rewards": [CHECKSUM_REWARD]},
    )
    policy = stages.open_run(config)
    ctx = held.policy(config, policy)
    scored, calls = [], []
    real_score, real_accumulate = (
        step_module.score_logprobs,
        step_module.group_gradient,
    )

    def spy_score(model, state, responses, **kwargs):
        out = real_score(model, state, responses, **kwargs)
        scored.append((model, state, out))
        return out

    def spy_accumulate(model, state, inputs, cfg, engine, **kwargs):
        fresh = prefill(model, state.prompt_ids, shard_tokens=config.engine.shard_tokens)
        same = all(torch.equal(fresh.tensors()[n], t) for n, t in state.tensors().items())
        grads, stats = real_accumulate(model, state, inputs, cfg, engine, **kwargs)
        calls.append(
            dict(
                state=state,
                version=ctx.policy_version,
                matches_current_weights=same,
                old=inputs.old_logprobs,
                logprobs=[torch.tensor(x) for x in stats.branch_logprobs],
            )
        )
        return grads, stats

    monkeypatch.setattr(step_module, "score_logprobs", spy_score)
    monkeypatch.setattr(step_module, "group_gradient", spy_accumulate)
    after, metrics = run_step(config, policy)

    assert ctx.policy_version == after.policy_version == 2 and metrics.policy_version == 0
    assert [c["version"] for c in calls] == [0, 0, 1, 1]  # 2 groups x 2 updates
    # Old log-probs: one no-grad replay per group by the policy of the rollout.
    assert len(scored) == 2 and all(model is ctx.model for model, _, _ in scored)
    for g in range(2):
        first, second = calls[g], calls[2 + g]
        # The old log-probs pass between stages as a stored record: the same values.
        for old_1, old_2, old_scored in zip(first["old"], second["old"], scored[g][2], strict=True):
            assert torch.equal(old_1, old_scored) and torch.equal(old_2, old_scored)
        assert not any(t.requires_grad for t in first["old"])
        # The first update runs on the rollout's weights: current log-probs equal the old ones.
        for old, now in zip(first["old"], first["logprobs"], strict=True):
            assert float((old - now).abs().max()) <= LOGP_ATOL
        # Every update reads a state of the weights it differentiates.
        assert first["matches_current_weights"] and second["matches_current_weights"]
        assert first["state"] is scored[g][1]
        assert second["state"] is not first["state"]
        changed = [
            not torch.equal(t, second["state"].tensors()[n])
            for n, t in first["state"].tensors().items()
        ]
        assert any(changed)
        # The second update sees the moved policy: its log-probs differ from the old ones.
        assert any(
            float((old - now).abs().max()) > LOGP_ATOL
            for old, now in zip(second["old"], second["logprobs"], strict=True)
        )
