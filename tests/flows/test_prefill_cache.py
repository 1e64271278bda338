"""Concurrent duplicate prefill-shard task runs: one computes, the other waits and hits the cache."""

from __future__ import annotations

import pytest
from flow_helpers import state_names, task_runs_of, tiny_run_config

pytestmark = pytest.mark.prefect


def test_concurrent_duplicate_shard_task_runs_compute_the_shard_once(prefect_harness, runs_root):
    from prefect import flow

    from longstraw.tasks.stages import open_run, plan_step, prefill_shard
    from longstraw.training import held

    config = tiny_run_config(runs_root, "duplicate-prefill", num_steps=1)
    held.forget_run(config.run_id)

    @flow(name="duplicate-prefill")
    def duplicates():
        policy = open_run(config)
        (prompt,) = plan_step(config, policy)
        # Two task runs with the same cache key at the same time (a duplicated flow run).
        futures = [prefill_shard.submit(config, policy, prompt, 0) for _ in range(2)]
        return [f.result() for f in futures], policy

    state = duplicates(return_state=True)
    assert state.is_completed(), state
    refs, policy = state.result()
    assert refs[0] == refs[1]
    assert refs[0].computed is True  # the cached copy is the first run's own result

    names = sorted(state_names(task_runs_of(state.state_details.flow_run_id), "prefill_shard"))
    # SERIALIZABLE isolation: the second waits for the first's lock, then reads its record.
    assert names == ["Cached", "Completed"]
    ctx = held.policy(config, policy)
    assert held.prefill_session(ctx, ctx.source(0)).shards_computed == 1
