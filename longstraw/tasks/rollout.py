"""Rollout and scoring tasks: sample a group from the committed state, score branches."""

from __future__ import annotations

from prefect import task

from longstraw.engine.rollout import score_responses
from longstraw.grpo.rewards import score_group
from longstraw.schemas.refs import PromptRef, RolloutRef
from longstraw.schemas.run import RunConfig
from longstraw.tasks import runtime
from longstraw.tasks.policies import retry_on_transient
from longstraw.training.step import GroupRollout, group_responses, reference_logprobs


@task(name="rollout_group", retries=1, retry_condition_fn=retry_on_transient)
def rollout_group(config: RunConfig, prompt: PromptRef) -> RolloutRef:
    """Sample G responses in one batch from the prompt's state and score their rewards."""
    ctx = runtime.run_context(config)
    example = ctx.source(prompt.index)
    session = runtime.session(ctx, example)
    state, outcome = session.finish()
    with runtime.timed(config.run_id, "rollout"):
        responses, weights = group_responses(ctx, example, state)
    with runtime.timed(config.run_id, "reward"):
        rewards = score_group(
            example.rewards,
            ctx.config.grpo.reward_weights,
            example.text or "",
            [r.text or "" for r in responses],
            example.metadata,
        )
    rollout = GroupRollout(
        example, state, outcome, responses, [float(r) for r in rewards], importance_weights=weights
    )
    handle = runtime.put_rollout(ctx, rollout)
    runtime.emit("rollout", prompt=prompt.prompt_id, rewards=rollout.rewards)
    return RolloutRef(
        handle=handle,
        prompt=prompt,
        response_ids=[r.token_ids for r in responses],
        sampler_logprobs=[r.logprobs for r in responses],
        texts=[r.text or "" for r in responses],
        truncated=[r.truncated for r in responses],
        rewards=rollout.rewards,
    )


@task(name="score_branches", retries=1, retry_condition_fn=retry_on_transient)
def score_branches(config: RunConfig, rollout: RolloutRef, which: str) -> list[list[float]] | None:
    """No-grad log-probs of the group's responses: `which` is "reference" (KL term, beta > 0;
    None without a reference model) or "old" (the rollout policy, for num_iterations > 1)."""
    if which not in ("reference", "old"):
        raise ValueError(f"which must be 'reference' or 'old', got {which!r}")
    ctx = runtime.run_context(config)
    group = runtime.get_rollout(rollout.handle)
    if which == "reference":
        with runtime.timed(config.run_id, "reference"):
            scored = reference_logprobs(ctx, group)
    else:
        scored = score_responses(
            ctx.model, group.state, rollout.response_ids, temperature=config.grpo.temperature
        )
    return None if scored is None else [t.tolist() for t in scored]
