"""Evaluation: the policy answers held-out prompts (`eval.data`) every `train.eval_steps` steps.

Each held-out prompt is prefilled at the weights the step's update made, decoded greedily (or
sampled, `eval.do_sample`) from a generator seeded by (seed, step, prompt), and its responses
are scored by the eval source's rewards. Nothing is trained and nothing but the numbers is kept:
no gradient, no rollout record, no persisted prompt state. The numbers go into the step's
`metrics.jsonl` row (`StepMetrics.eval`), so they reach the trackers as `eval/...` with the
row, and a resumed run evaluates only the steps it runs again (with the same numbers: the
weights and the draws are the same).

A stage like rollout: on `parallel.world_size > 1` every rank prefills its part of each prompt
and decodes together (the same draws on every rank), and rank 0 scores the rewards.
"""

from __future__ import annotations

import torch

from longstraw.data.rewards import register_haystack_rewards
from longstraw.distributed.stage_group import from_writer, is_writer, on_all_ranks
from longstraw.engine.rollout import SamplingParams, sample_responses
from longstraw.grpo.rewards import score_group as score_rewards
from longstraw.schemas.refs import PolicyRef
from longstraw.schemas.results import EvalMetrics
from longstraw.schemas.run import RunConfig
from longstraw.training import held
from longstraw.training.stages import grpo_sampling
from longstraw.training.storage_faults import storage_faults
from longstraw.training.streamed_state import budgeted_state


def is_eval_step(config: RunConfig, steps_done: int) -> bool:
    """Whether the policy after `steps_done` steps is evaluated (every `train.eval_steps`)."""
    every = config.train.eval_steps
    return every is not None and steps_done > 0 and steps_done % every == 0


def eval_sampling_params(config: RunConfig, eos_token_id: int | None) -> SamplingParams:
    """How held-out prompts are decoded: greedy is top-k 1 (the decoder's argmax, equal to
    transformers' `generate(do_sample=False)`), else `eval.temperature` with GRPO's filters."""
    cfg, grpo = config.eval, config.grpo
    stops = () if eos_token_id is None else (int(eos_token_id),)
    if not cfg.do_sample:
        return SamplingParams(
            num_samples=1,
            max_new_tokens=grpo.max_completion_length,
            top_k=1,
            stop_token_ids=stops,
        )
    return grpo_sampling(grpo, eos_token_id, cfg.num_generations, cfg.temperature)


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and Bessel-corrected standard deviation in float64, as a step's `reward`."""
    flat = torch.tensor(values, dtype=torch.float64)
    return float(flat.mean()), float(flat.std()) if len(values) > 1 else 0.0


@on_all_ranks
@storage_faults
def evaluate(config: RunConfig, policy: PolicyRef) -> EvalMetrics:
    """Answer every held-out prompt with the weights `policy` names; their rewards' summary.
    `policy.step` is the steps done (the draws depend on it)."""
    if config.eval is None:
        raise ValueError("evaluate needs an eval section in the run config (eval.data)")
    ctx = held.policy(config, policy)
    ctx.gather_weights()
    params = eval_sampling_params(config, ctx.tokenizer.eos_token_id)
    register_haystack_rewards()  # the built-in names eval.data.rewards may list
    rewards: list[list[float]] = []
    lengths: list[int] = []
    truncated: list[bool] = []
    for index in range(len(ctx.eval_source)):
        example = ctx.eval_source(index)
        with (
            held.eval_state(ctx, example) as prefix,
            budgeted_state(config.engine, ctx.model, prefix) as state,
        ):
            responses = sample_responses(
                ctx.model,
                state,
                params,
                generator=held.eval_generator(config, policy.step, index),
                tokenizer=ctx.tokenizer,
                exchange=held.prefix_exchange(),
            )
        # The training weights apply to the training rewards only; other rewards count 1 each.
        same = list(example.rewards) == list(config.data.rewards)
        group = (
            score_rewards(
                example.rewards,
                config.grpo.reward_weights if same else None,
                example.text or "",
                [r.text or "" for r in responses],
                example.metadata,
                where=f"held-out prompt {example.prompt_id!r} (eval {index} after step "
                f"{policy.step - 1})",
            )
            if is_writer()
            else []
        )
        rewards.append([float(x) for x in group])
        lengths += [len(r.token_ids) for r in responses]
        truncated += [r.truncated for r in responses]
    # Rewards run once, on rank 0 (as in rollout); every rank returns the same numbers.
    rewards = from_writer(rewards)
    flat = [x for group in rewards for x in group]
    mean, std = _mean_std(flat)
    return EvalMetrics(
        policy_version=policy.policy_version,
        num_prompts=len(rewards),
        num_completions=len(flat),
        reward_mean=mean,
        reward_std=std,
        reward_min=min(flat),
        reward_max=max(flat),
        completion_length_mean=sum(lengths) / len(lengths),
        truncated_fraction=sum(truncated) / len(truncated),
        rewards=rewards,
    )


def evaluate_checkpoint(config: RunConfig) -> EvalMetrics:
    """The held-out prompts answered by `model.checkpoint` as it is, without training
    (`longstraw eval`; one process). A checkpoint a run wrote is evaluated with the draws of the
    step that wrote it, so a sampled evaluation gives the numbers that step recorded; any other
    checkpoint with those of step 0 (the first point of a learning curve)."""
    import json
    from pathlib import Path

    from longstraw.storage.checkpoints import TRAINER_STATE
    from longstraw.training.context import start_policy

    policy = start_policy(config)
    trainer_state = Path(policy.checkpoint.uri.removeprefix("file://")) / TRAINER_STATE
    if trainer_state.is_file():
        # Checkpoints written otherwise (through `commit_checkpoint` by a script) may not say.
        step = json.loads(trainer_state.read_text()).get("step", 0)
        policy = policy.model_copy(update={"step": int(step)})
    return evaluate(config, policy)
