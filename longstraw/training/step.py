"""One GRPO step as separate stages: rollout, rewards, advantages, reference, gradient, update.

Each stage is a function of plain values so that a Prefect task can wrap it (refs in, refs out);
`run_step` composes them for the in-process path. A step prefills each group's prompt once and
uses that state for rollout, scoring and every branch's gradient.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import torch

import longstraw.data.rewards  # noqa: F401  (registers the synthetic tasks' rewards)
from longstraw.engine.group import GradBuffer, accumulate_group_gradients
from longstraw.engine.rollout import Response, SamplingParams, sample_responses, score_responses
from longstraw.engine.state import PrefixState
from longstraw.grpo.advantages import group_advantages
from longstraw.grpo.losses import loss_mask
from longstraw.grpo.optim import UpdateStats
from longstraw.grpo.rewards import score_group
from longstraw.schemas.refs import UpdateResult
from longstraw.schemas.results import GroupStats, StepMetrics
from longstraw.schemas.storage import StateKey
from longstraw.training.context import RunContext
from longstraw.training.imported import imported_importance_weights
from longstraw.training.persisted_prefill import PrefillOutcome, persisted_prefill
from longstraw.training.prompts import PromptExample


@dataclass
class GroupRollout:
    """One prompt's group: its state, the sampled responses and their rewards."""

    example: PromptExample
    state: PrefixState
    prefill: PrefillOutcome
    responses: list[Response]
    rewards: list[float]
    seconds: dict[str, float] = field(default_factory=dict)
    importance_weights: list[torch.Tensor] | None = None
    """[G][R_i] truncated importance weights of imported responses (None for own rollouts)."""


def policy_state(ctx: RunContext, example: PromptExample) -> tuple[PrefixState, PrefillOutcome]:
    """The current policy's state of `example` (reused from storage when already committed)."""
    return persisted_prefill(
        ctx.model,
        example.prompt_ids,
        shard_tokens=ctx.config.engine.shard_tokens,
        storage=ctx.config.storage,
        key=policy_key(ctx, example),
    )


def policy_key(ctx: RunContext, example: PromptExample) -> StateKey:
    """Storage key of `example`'s state under the run's current weights."""
    return StateKey.policy(
        ctx.config.run_id, ctx.policy_version, ctx.weights_digest, example.digest
    )


def sampling_params(ctx: RunContext) -> SamplingParams:
    cfg = ctx.config.grpo
    eos = ctx.tokenizer.eos_token_id
    return SamplingParams(
        num_samples=cfg.num_generations,
        max_new_tokens=cfg.max_completion_length,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        stop_token_ids=() if eos is None else (int(eos),),
    )


def rollout_group(ctx: RunContext, example: PromptExample) -> GroupRollout:
    """Prefill (or reuse) the prompt state, sample G responses from it, score them."""
    seconds = {}
    started = time.perf_counter()
    state, outcome = policy_state(ctx, example)
    seconds["prefill"] = time.perf_counter() - started
    started = time.perf_counter()
    responses, weights = group_responses(ctx, example, state)
    seconds["rollout"] = time.perf_counter() - started
    started = time.perf_counter()
    rewards = score_group(
        example.rewards,
        ctx.config.grpo.reward_weights,
        example.text or "",
        [r.text or "" for r in responses],
        example.metadata,
    )
    seconds["reward"] = time.perf_counter() - started
    return GroupRollout(
        example, state, outcome, responses, [float(r) for r in rewards], seconds, weights
    )


def group_responses(
    ctx: RunContext, example: PromptExample, state: PrefixState
) -> tuple[list[Response], list[torch.Tensor] | None]:
    """Sample the group here, or take it from the run's imported responses (with TIS weights)."""
    imported = getattr(ctx.source, "imported", None)
    if imported is None:
        responses = sample_responses(
            ctx.model, state, sampling_params(ctx), generator=ctx.generator, tokenizer=ctx.tokenizer
        )
        return responses, None
    responses = imported.group(example.prompt_id, ctx.policy_version)
    cfg = ctx.config.grpo
    weights = None
    if cfg.vllm_importance_sampling_correction:
        weights = imported_importance_weights(
            ctx.model,
            state,
            responses,
            temperature=cfg.temperature,
            cap=cfg.vllm_importance_sampling_cap,
        )
    return responses, weights


def reference_state(ctx: RunContext, example: PromptExample) -> PrefixState:
    """The reference model's state of `example`: prefilled once per prompt and run.

    Keyed by the reference weights digest only. With persistence on, storage holds it (a committed
    state reads back free in-process); with persist_mode off, the run context keeps it.
    """
    keep = ctx.config.storage.persist_mode == "off"
    if keep and example.digest in ctx.reference_states:
        return ctx.reference_states[example.digest]
    key = StateKey.reference(ctx.reference_digest, example.digest)
    state, _ = persisted_prefill(
        ctx.reference_model,
        example.prompt_ids,
        shard_tokens=ctx.config.engine.shard_tokens,
        storage=ctx.config.storage,
        key=key,
    )
    if keep:
        ctx.reference_states[example.digest] = state
    return state


def reference_logprobs(ctx: RunContext, rollout: GroupRollout) -> list[torch.Tensor] | None:
    """Reference-model log-probs of the group's responses (beta > 0), from its own prompt state.

    The reference state is keyed by the reference weights digest only: computed once per prompt,
    then read back (free in-process) at every later step.
    """
    if ctx.reference_model is None:
        return None
    state = reference_state(ctx, rollout.example)
    return score_responses(
        ctx.reference_model,
        state,
        [r.token_ids for r in rollout.responses],
        temperature=ctx.config.grpo.temperature,
    )


def response_masks(ctx: RunContext, rollout: GroupRollout) -> list[torch.Tensor]:
    """[G][R_i] loss masks (truncated completions zeroed when mask_truncated_completions)."""
    return [
        loss_mask(torch.ones(len(r.token_ids)), r.truncated, ctx.config.grpo)
        for r in rollout.responses
    ]


def group_gradient(
    ctx: RunContext,
    rollout: GroupRollout,
    advantages_G: torch.Tensor,
    *,
    masks: list[torch.Tensor],
    ref_logprobs: list[torch.Tensor] | None,
    old_logprobs: list[torch.Tensor] | None,
    num_items_in_batch: float,
    num_sequences_in_batch: int,
) -> tuple[GradBuffer, GroupStats]:
    """This group's fp32 gradient contribution, from zeroed buffers (safe to retry)."""
    grads = GradBuffer(ctx.model)
    stats = accumulate_group_gradients(
        ctx.model,
        rollout.state,
        [r.token_ids for r in rollout.responses],
        advantages_G,
        ctx.config.grpo,
        shard_tokens=ctx.config.engine.shard_tokens,
        prompt_grad=ctx.config.engine.prompt_grad,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        loss_masks=masks,
        num_items_in_batch=num_items_in_batch,
        num_sequences_in_batch=num_sequences_in_batch,
        grad_buffer=grads,
        importance_weights=rollout.importance_weights,
    )
    return grads, stats


def reduce_gradients(contributions: list[GradBuffer]) -> GradBuffer:
    """Sum of the groups' contributions (the normaliser was applied once, before replay)."""
    total = contributions[0]
    for other in contributions[1:]:
        total.add_(other)
    return total


def apply_update(ctx: RunContext, grads: GradBuffer) -> UpdateStats:
    """Optimizer step; the policy version increments."""
    update = ctx.optimizer.apply(grads)
    ctx.policy_version += 1
    return update


def _std(values: torch.Tensor) -> float:
    return float(values.std()) if values.numel() > 1 else 0.0


def run_step(ctx: RunContext) -> StepMetrics:
    """Rollout every group of the step, then `num_iterations` updates on those rollouts."""
    cfg = ctx.config
    seconds: dict[str, float] = {}

    def add(stage: str, value: float) -> None:
        seconds[stage] = seconds.get(stage, 0.0) + value

    version_at_rollout = ctx.policy_version
    first = ctx.step * cfg.train.groups_per_step
    rollouts = []
    for index in range(first, first + cfg.train.groups_per_step):
        rollout = rollout_group(ctx, ctx.source(index))
        for stage, value in rollout.seconds.items():
            add(stage, value)
        rollouts.append(rollout)

    rewards = torch.tensor([r.rewards for r in rollouts], dtype=torch.float64)  # [groups, G]
    advantages = group_advantages(rewards, cfg.grpo.scale_rewards).to(torch.float32)
    masks = [response_masks(ctx, r) for r in rollouts]
    num_items = float(sum(float(m.sum()) for group in masks for m in group))
    num_sequences = sum(len(group) for group in masks)

    started = time.perf_counter()
    refs = [reference_logprobs(ctx, r) for r in rollouts]
    add("reference", time.perf_counter() - started)
    # More than one update per rollout needs the rollout policy's log-probs (no-grad replay).
    olds = (
        [
            score_responses(
                ctx.model,
                r.state,
                [x.token_ids for x in r.responses],
                temperature=cfg.grpo.temperature,
            )
            for r in rollouts
        ]
        if cfg.grpo.num_iterations > 1
        else [None] * len(rollouts)
    )

    group_stats: list[GroupStats] = []
    update = None
    for iteration in range(cfg.grpo.num_iterations):
        if iteration > 0:
            # The weights changed: the prompt states must be recomputed for the new version.
            for rollout in rollouts:
                started = time.perf_counter()
                rollout.state, _ = policy_state(ctx, rollout.example)
                add("prefill", time.perf_counter() - started)
        contributions, group_stats = [], []
        for g, rollout in enumerate(rollouts):
            grads, stats = group_gradient(
                ctx,
                rollout,
                advantages[g],
                masks=masks[g],
                ref_logprobs=refs[g],
                old_logprobs=olds[g],
                num_items_in_batch=num_items,
                num_sequences_in_batch=num_sequences,
            )
            add("replay", stats.seconds.replay)
            add("sweep", stats.seconds.sweep)
            contributions.append(grads)
            group_stats.append(stats)
        started = time.perf_counter()
        update = apply_update(ctx, reduce_gradients(contributions))
        add("update", time.perf_counter() - started)

    ctx.step += 1
    metrics = step_metrics(
        step=ctx.step - 1,
        policy_version=version_at_rollout,
        rewards=rewards,
        advantages=advantages,
        group_stats=group_stats,
        update=update,
        prompt_tokens=sum(r.state.prompt_len for r in rollouts),
        num_items=num_items,
        truncated=[x.truncated for r in rollouts for x in r.responses],
        seconds=seconds,
        shards_computed=sum(r.prefill.shards_computed for r in rollouts),
        shards_reused=sum(r.prefill.shards_reused for r in rollouts),
    )
    ctx.history.append(metrics)
    return metrics


def step_metrics(
    *,
    step: int,
    policy_version: int,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    group_stats: list[GroupStats],
    update: UpdateStats | UpdateResult,
    prompt_tokens: int,
    num_items: float,
    truncated: list[bool],
    seconds: dict[str, float],
    shards_computed: int,
    shards_reused: int,
) -> StepMetrics:
    """The audit record of one step (`rewards`/`advantages` [groups, G]), for both the in-process
    loop and the Prefect flow."""
    kls = [s.kl for s in group_stats if s.kl is not None]
    count = max(len(group_stats), 1)
    return StepMetrics(
        step=step,
        policy_version=policy_version,
        reward_mean=float(rewards.mean()),
        reward_std=_std(rewards.flatten()),
        advantage_mean=float(advantages.mean()),
        advantage_std=_std(advantages.flatten()),
        advantage_min=float(advantages.min()),
        advantage_max=float(advantages.max()),
        loss=sum(s.loss for s in group_stats),
        kl=sum(kls) / len(kls) if kls else None,
        clip_ratio_low=sum(s.clip_ratio_low for s in group_stats) / count,
        clip_ratio_high=sum(s.clip_ratio_high for s in group_stats) / count,
        clip_ratio_region=sum(s.clip_ratio_region for s in group_stats) / count,
        grad_norm=update.grad_norm,
        learning_rate=update.learning_rate,
        prompt_tokens=prompt_tokens,
        completion_tokens=int(num_items),
        num_groups=rewards.shape[0],
        truncated_fraction=sum(truncated) / max(len(truncated), 1),
        seconds=seconds,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        shards_computed=shards_computed,
        shards_reused=shards_reused,
    )
