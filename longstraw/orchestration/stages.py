"""The step's stages as Prefect tasks: one thin task per stage function, nothing else.

Each task calls its stage (`longstraw.training.stages`) with the same arguments — configs and
refs — and returns its refs; Prefect adds retries, caching, names and the audit trail. A task
retried or run in another process gives the same result, because the stage rebuilds what its refs
name from storage.
"""

from __future__ import annotations

from prefect import task

from longstraw.orchestration.policies import retry_on_transient, serializable_cache_policy
from longstraw.training import stages
from longstraw.training.step import Stages

_RETRY = {"retries": 1, "retry_delay_seconds": 1, "retry_condition_fn": retry_on_transient}

open_run = task(name="open_run")(stages.open_run)
plan_step = task(name="plan_step")(stages.plan_step)
# Cached per (run, weights, prompt, version, shard, config): a flow rerun after a crash skips
# every shard that finished; the storage manifest stays the source of truth.
prefill_shard = task(
    name="prefill_shard",
    cache_policy=serializable_cache_policy(),
    persist_result=True,
    result_serializer="json",
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=retry_on_transient,
)(stages.prefill_shard)
prefill_prompt = task(name="prefill_prompt", **_RETRY)(stages.prefill_prompt)
rollout_group = task(name="rollout_group", **_RETRY)(stages.rollout_group)
score_group = task(name="score_group", **_RETRY)(stages.score_group)
compute_advantages = task(name="compute_advantages")(stages.compute_advantages)
backward_group = task(name="backward_group", **_RETRY)(stages.backward_group)
reduce_gradients = task(name="reduce_gradients", **_RETRY)(stages.reduce_gradients)
apply_update = task(name="apply_update")(stages.apply_update)
write_checkpoint = task(name="write_checkpoint", **_RETRY)(stages.write_checkpoint)
record_step = task(name="record_step")(stages.record_step)


def prefect_stages(on_prefill_shard=None) -> Stages:
    """The step's stages as these tasks (`longstraw.training.step.run_step` composes them)."""
    return Stages(
        plan_step=plan_step,
        prefill_shard=prefill_shard,
        prefill_prompt=prefill_prompt,
        rollout_group=rollout_group,
        score_group=score_group,
        compute_advantages=compute_advantages,
        backward_group=backward_group,
        reduce_gradients=reduce_gradients,
        apply_update=apply_update,
        write_checkpoint=write_checkpoint,
        record_step=record_step,
        on_prefill_shard=on_prefill_shard,
    )
