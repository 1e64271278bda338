"""A whole `grpo_step` flow on the session's Prefect harness: metrics, checkpoint, artifacts."""

from __future__ import annotations

import json
import math

import pytest
from flow_helpers import (
    NUM_GENERATIONS,
    NUM_SHARDS,
    PROMPT_TOKENS,
    artifacts_of,
    state_names,
    task_runs_of,
    tiny_run_config,
)

pytestmark = pytest.mark.prefect


def test_grpo_step_flow_trains_one_step_checkpoints_and_records_artifacts(
    prefect_harness, runs_root
):
    from transformers import AutoModelForCausalLM

    from longstraw.flows.grpo_step import grpo_step
    from longstraw.models.checkpoint import read_checkpoint_metadata
    from longstraw.storage.checkpoints import latest_checkpoint
    from longstraw.tasks.stages import open_run
    from longstraw.training import held

    config = tiny_run_config(runs_root, "grpo-step-flow", num_steps=2)
    held.forget_run(config.run_id)

    state = grpo_step(config, open_run.fn(config), return_state=True)
    assert state.is_completed(), state
    policy, metrics = state.result()
    assert (policy.step, policy.policy_version) == (1, 1)

    assert metrics.step == 0 and metrics.policy_version == 0
    assert metrics.num_groups == 1
    assert metrics.prompt_tokens == PROMPT_TOKENS
    assert 0 < metrics.completion_tokens <= NUM_GENERATIONS * 2
    assert metrics.shards_computed == NUM_SHARDS and metrics.shards_reused == 0
    assert metrics.grad_norm > 0 and math.isfinite(metrics.loss)
    assert metrics.reward_std > 0, "the tiny reward must vary, or the step trains nothing"
    # Every stage's seconds land in the step that spent them, the checkpoint's included.
    assert {"prefill", "rollout", "replay", "sweep", "update", "checkpoint"} <= set(
        metrics.seconds
    ), metrics.seconds

    # checkpoint_every=1: the step's update (version 1) was committed and loads in transformers.
    path = latest_checkpoint(config.storage, config.run_id)
    assert path is not None and path.name == "v000001"
    assert read_checkpoint_metadata(path).policy_version == 1
    model = AutoModelForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) > 0

    flow_run_id = state.state_details.flow_run_id
    runs = task_runs_of(flow_run_id)
    assert state_names(runs, "prefill_shard") == ["Completed"] * NUM_SHARDS
    for name in ("plan_step", "prefill_prompt", "rollout_group", "compute_advantages"):
        assert state_names(runs, name) == ["Completed"], (name, [r.name for r in runs])
    for name in ("backward_group", "reduce_gradients", "apply_update", "record_step"):
        assert state_names(runs, name) == ["Completed"], (name, [r.name for r in runs])
    assert state_names(runs, "write_checkpoint") == ["Completed"]

    every = artifacts_of(flow_run_id)
    artifacts = {a.type: a for a in every if a.task_run_id is None}
    assert artifacts["progress"].data == pytest.approx(100.0)
    # The backward task shows its group's reverse sweep: every shard swept.
    (backward,) = [r for r in runs if r.task_key.rsplit("-", 1)[0] == "backward_group"]
    (sweep,) = [a for a in every if a.type == "progress" and a.task_run_id == backward.id]
    assert sweep.description == f"sweep shards of group 0 ({NUM_SHARDS})"
    assert sweep.data == pytest.approx(100.0)
    table = artifacts["table"]
    assert table.key == "grpo-step-flow-step"
    rows = table.data if isinstance(table.data, list) else json.loads(table.data)
    assert rows[0]["step"] == 0
    assert rows[0]["shards_computed"] == NUM_SHARDS
    # The UI's table shows 4 significant digits (metrics.jsonl keeps full precision).
    assert rows[0]["reward_mean"] == float(f"{metrics.reward_mean:.4g}")
    assert "seconds_replay" in rows[0]
