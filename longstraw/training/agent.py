"""The rollout stage of an agent run: trajectories sampled with the run's environment, and
their rewards."""

from __future__ import annotations

from longstraw.data.environments import environment_factory
from longstraw.data.trajectory import ChatFraming
from longstraw.engine.agent_rollout import AgentTrajectory, TurnLimits, sample_agent_group
from longstraw.grpo.rewards import score_group as score_rewards
from longstraw.training import held

# Prompts longer than this are not handed to the environment as text (a 2M-token prompt is
# ~8 MB of text per trajectory); environments fall back on the task metadata.
_MAX_PROMPT_TEXT_CHARS = 1 << 20


def environment_metadata(example) -> dict:
    """What `Environment.reset` receives: the task metadata and, when kept, the prompt text."""
    metadata = dict(example.metadata)
    if example.text is not None and len(example.text) <= _MAX_PROMPT_TEXT_CHARS:
        metadata["prompt_text"] = example.text
    return metadata


def sample_trajectories(ctx, state, example, params, generator) -> list[AgentTrajectory]:
    """G trajectories of the run's environment from `state` (`params` from the GRPO config)."""
    agent, grpo = ctx.config.agent, ctx.config.grpo
    limits = TurnLimits(
        max_turns=agent.max_turns,
        max_turn_tokens=agent.max_turn_tokens,
        max_branch_tokens=grpo.max_completion_length,
        step_timeout_s=agent.step_timeout_s,
    )
    return sample_agent_group(
        ctx.model,
        state,
        environment_factory(agent.environment, agent.environment_args),
        environment_metadata(example),
        ChatFraming.from_tokenizer(ctx.tokenizer),
        limits,
        params,
        generator=generator,
        tokenizer=ctx.tokenizer,
        exchange=held.prefix_exchange(),
    )


def trajectory_rewards(
    config, example, trajectories: list[AgentTrajectory], *, where: str | None = None
) -> list[float]:
    """[G] the environment's reward; `agent.error_reward` after an error; `data.rewards` on the
    last assistant turn when the environment gave none."""
    rewards: list[float | None] = [
        config.agent.error_reward if t.error is not None else t.reward for t in trajectories
    ]
    unscored = [i for i, r in enumerate(rewards) if r is None]
    if unscored:
        scored = score_rewards(
            example.rewards,
            config.grpo.reward_weights,
            example.text or "",
            [trajectories[i].text for i in unscored],
            example.metadata,
            where=where,
        )
        for i, reward in zip(unscored, scored, strict=True):
            rewards[i] = reward
    return [float(r) for r in rewards]
