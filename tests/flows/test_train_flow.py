"""The `train` flow: same weights as the in-process loop, resume, and cached prefill shards."""

from __future__ import annotations

import shutil

import pytest
from flow_helpers import (
    NUM_SHARDS,
    artifacts_of,
    final_weights_digest,
    state_names,
    task_runs_of,
    tiny_run_config,
)

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


def _train(config, *, resume: bool):
    from longstraw.flows.train import train

    state = train(config.model_dump(mode="json"), resume=resume, return_state=True)
    assert state.is_completed(), state
    return state.result(), state.state_details.flow_run_id


def test_train_flow_matches_in_process_loop(prefect_harness, runs_root, in_process_digest):
    config = tiny_run_config(runs_root, "flow-uninterrupted", num_steps=2)
    history, flow_run_id = _train(config, resume=False)

    assert [m.step for m in history] == [0, 1]
    assert [m.policy_version for m in history] == [0, 1]
    # Both paths are deterministic on CPU and draw the same samples: bitwise the same weights.
    assert final_weights_digest(config) == in_process_digest

    artifacts = {a.key: a for a in artifacts_of(flow_run_id) if a.key}
    assert {"flow-uninterrupted-metrics", "flow-uninterrupted-reward-curve"} <= set(artifacts)
    assert "# Reward curve" in artifacts["flow-uninterrupted-reward-curve"].data


def test_resumed_train_flow_matches_uninterrupted_and_reuses_committed_shards(
    prefect_harness, runs_root, in_process_digest
):
    # A 1-step run, then a resumed run to 2 steps (the learning rate is constant, so the
    # optimizer trajectory does not depend on num_steps).
    first, _ = _train(tiny_run_config(runs_root, "flow-resumed", num_steps=1), resume=False)
    assert [m.step for m in first] == [0]
    config = tiny_run_config(runs_root, "flow-resumed", num_steps=2)
    second, _ = _train(config, resume=True)
    assert [m.step for m in second] == [1]
    assert (second[0].shards_computed, second[0].shards_reused) == (NUM_SHARDS, 0)
    assert final_weights_digest(config) == in_process_digest

    # Lose step 1's checkpoint (a crash after the prompt state was committed) and redo step 1:
    # no prefill shard is computed again — the shard tasks are Cached and the commit reads the
    # committed state back.
    checkpoint = runs_root / "runs" / "flow-resumed" / "checkpoints" / "v000002"
    assert checkpoint.is_dir()
    shutil.rmtree(checkpoint)
    third, flow_run_id = _train(config, resume=True)
    assert [m.step for m in third] == [1]
    assert (third[0].shards_computed, third[0].shards_reused) == (0, NUM_SHARDS)
    assert state_names(task_runs_of(flow_run_id), "prefill_shard") == ["Cached"] * NUM_SHARDS
    assert final_weights_digest(config) == in_process_digest
