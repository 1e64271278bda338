"""Gradient tasks: one group's backward (replay + exact sweep), the reduction, the update."""

from __future__ import annotations

import torch
from prefect import task

from longstraw.schemas.refs import CheckpointRef, GradRef, RolloutRef, UpdateResult
from longstraw.schemas.run import RunConfig
from longstraw.tasks import runtime
from longstraw.tasks.policies import retry_on_transient
from longstraw.training.loop import is_checkpoint_step, plot_rewards, save_checkpoint
from longstraw.training.step import apply_update as apply_optimizer_update
from longstraw.training.step import group_gradient
from longstraw.training.step import reduce_gradients as sum_contributions


@task(name="backward_group", retries=1, retry_condition_fn=retry_on_transient)
def backward_group(
    config: RunConfig,
    rollout: RolloutRef,
    advantages: list[float],
    loss_masks: list[list[float]],
    num_items_in_batch: float,
    num_sequences_in_batch: int,
    ref_logprobs: list[list[float]] | None = None,
    old_logprobs: list[list[float]] | None = None,
) -> GradRef:
    """Replay the group's branches one at a time (and, in exact mode, sweep the prefill shards in
    reverse) into zeroed fp32 buffers; returns the contribution. The prompt cotangent dS lives
    and dies inside this task, so a retry starts from zero and cannot double-count.

    Replay and the reverse sweep are this one task, not two: dS only exists between them, so one
    idempotent unit is what makes a retry safe.
    """
    ctx = runtime.run_context(config)
    group = runtime.get_rollout(rollout.handle)
    # The state of the model's current version (the rollout's, unless an earlier iteration of
    # this step already updated the weights: then the session recomputes it).
    with runtime.timed(config.run_id, "prefill"):
        group.state, _ = runtime.session(ctx, group.example).finish()
    grads, stats = group_gradient(
        ctx,
        group,
        torch.tensor(advantages, dtype=torch.float32),
        masks=[torch.tensor(m) for m in loss_masks],
        ref_logprobs=None if ref_logprobs is None else [torch.tensor(r) for r in ref_logprobs],
        old_logprobs=None if old_logprobs is None else [torch.tensor(o) for o in old_logprobs],
        num_items_in_batch=num_items_in_batch,
        num_sequences_in_batch=num_sequences_in_batch,
    )
    runtime.add_seconds(config.run_id, "replay", stats.seconds.replay)
    runtime.add_seconds(config.run_id, "sweep", stats.seconds.sweep)
    runtime.emit("backward", prompt=rollout.prompt.prompt_id, loss=stats.loss)
    ref = runtime.put_grads(
        grads, policy_version=ctx.policy_version, num_tokens=sum(stats.num_tokens)
    )
    runtime.group_stats[ref.uri] = stats
    return ref


@task(name="reduce_gradients")
def reduce_gradients(grads: list[GradRef]) -> GradRef:
    """Sum the groups' contributions (the normaliser was applied once, before replay)."""
    versions = {g.policy_version for g in grads}
    if len(versions) != 1:
        raise ValueError(
            f"gradients of different policy versions {sorted(versions)} cannot be summed"
        )
    total = sum_contributions([runtime.take_grads(g) for g in grads])
    return runtime.put_grads(
        total, policy_version=versions.pop(), num_tokens=sum(g.num_tokens for g in grads)
    )


@task(name="apply_update")
def apply_update(config: RunConfig, grads: GradRef, *, final_of_step: bool) -> UpdateResult:
    """Optimizer step → new policy version; checkpoint when the cadence says so."""
    ctx = runtime.run_context(config)
    if grads.policy_version != ctx.policy_version:
        raise ValueError(
            f"gradient was taken at policy version {grads.policy_version}, the model is at "
            f"{ctx.policy_version}: recompute the step's backward"
        )
    with runtime.timed(config.run_id, "update"):
        update = apply_optimizer_update(ctx, runtime.take_grads(grads))
    runtime.drop_sessions_before(config.run_id, ctx.policy_version)
    if final_of_step:
        ctx.step += 1
    return UpdateResult(
        policy_version=ctx.policy_version,
        grad_norm=update.grad_norm,
        learning_rate=update.learning_rate,
        clipped=update.clipped,
    )


@task(name="write_checkpoint", retries=1, retry_condition_fn=retry_on_transient)
def write_checkpoint(config: RunConfig) -> CheckpointRef | None:
    """Commit a checkpoint when the cadence asks for one at the run's current step."""
    ctx = runtime.run_context(config)
    if not is_checkpoint_step(ctx):
        return None
    with runtime.timed(config.run_id, "checkpoint"):
        ref = save_checkpoint(ctx)
        plot_rewards(ctx.run_path, ctx.history)
    return ref
