"""Bookkeeping tasks: which prompts a step uses, the advantages, the step's metrics."""

from __future__ import annotations

import torch
from prefect import task
from pydantic import BaseModel, ConfigDict

from longstraw.engine.state import shard_bounds
from longstraw.grpo.advantages import group_advantages
from longstraw.grpo.losses import loss_mask
from longstraw.schemas.refs import GradRef, PromptRef, RolloutRef, UpdateResult
from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig
from longstraw.tasks import runtime
from longstraw.training.step import step_metrics


class StepStart(BaseModel):
    """Where a run stands when a flow opens it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int
    policy_version: int
    weights_digest: str


class AdvantagePlan(BaseModel):
    """Advantages, loss masks and the step's normalisers, fixed before any replay."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    advantages: list[list[float]]
    """[groups][G]"""
    loss_masks: list[list[list[float]]]
    """[groups][G][R_i]"""
    num_items_in_batch: float
    num_sequences_in_batch: int


@task(name="open_run")
def open_run_task(config: RunConfig, resume: bool) -> StepStart:
    """Open (or resume) the run in this process."""
    ctx = runtime.start_run(config, resume=resume)
    return StepStart(
        step=ctx.step, policy_version=ctx.policy_version, weights_digest=ctx.weights_digest
    )


@task(name="plan_step")
def plan_step(config: RunConfig) -> list[PromptRef]:
    """The prompts of the run's next step, at the model's current policy version."""
    ctx = runtime.run_context(config)
    first = ctx.step * config.train.groups_per_step
    prompts = []
    for index in range(first, first + config.train.groups_per_step):
        example = ctx.source(index)
        prompts.append(
            PromptRef(
                index=index,
                prompt_id=example.prompt_id,
                prompt_digest=example.digest,
                num_tokens=example.prompt_ids.numel(),
                num_shards=len(
                    shard_bounds(example.prompt_ids.numel() - 1, config.engine.shard_tokens)
                ),
                policy_version=ctx.policy_version,
                weights_digest=ctx.weights_digest,
            )
        )
    return prompts


@task(name="compute_advantages")
def compute_advantages(config: RunConfig, rollouts: list[RolloutRef]) -> AdvantagePlan:
    """Group-relative advantages (TRL's scale_rewards) and the global normalisers."""
    rewards = torch.tensor([r.rewards for r in rollouts], dtype=torch.float64)
    advantages = group_advantages(rewards, config.grpo.scale_rewards)
    masks = [
        [
            loss_mask(torch.ones(len(ids)), truncated, config.grpo).tolist()
            for ids, truncated in zip(r.response_ids, r.truncated, strict=True)
        ]
        for r in rollouts
    ]
    return AdvantagePlan(
        advantages=advantages.tolist(),
        loss_masks=masks,
        num_items_in_batch=float(sum(sum(m) for group in masks for m in group)),
        num_sequences_in_batch=sum(len(group) for group in masks),
    )


@task(name="summarize_step")
def summarize_step(
    config: RunConfig,
    rollouts: list[RolloutRef],
    plan: AdvantagePlan,
    grads: list[GradRef],
    update: UpdateResult,
    shards_computed: int,
    shards_reused: int,
) -> StepMetrics:
    """The step's audit record (also appended to the run's history for checkpoints and plots)."""
    ctx = runtime.run_context(config)
    stats = [runtime.group_stats.pop(g.uri) for g in grads if g.uri in runtime.group_stats]
    metrics = step_metrics(
        step=ctx.step - 1,
        policy_version=rollouts[0].prompt.policy_version,
        rewards=torch.tensor([r.rewards for r in rollouts], dtype=torch.float64),
        advantages=torch.tensor(plan.advantages, dtype=torch.float64),
        group_stats=stats,
        update=update,
        prompt_tokens=sum(r.prompt.num_tokens for r in rollouts),
        num_items=plan.num_items_in_batch,
        truncated=[t for r in rollouts for t in r.truncated],
        seconds=runtime.take_seconds(config.run_id),
        shards_computed=shards_computed,
        shards_reused=shards_reused,
    )
    ctx.history.append(metrics)
    from longstraw.training.loop import append_metrics

    append_metrics(ctx.run_path, metrics)
    runtime.emit("step", step=metrics.step)
    return metrics
