"""The `grpo_step` flow: one GRPO step wired from tasks (no math here)."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig
from longstraw.tasks.backward import (
    apply_update,
    backward_group,
    reduce_gradients,
    write_checkpoint,
)
from longstraw.tasks.plan import compute_advantages, plan_step, summarize_step
from longstraw.tasks.prefill import commit_prompt_state, prefill_prompt_shard
from longstraw.tasks.rollout import rollout_group, score_branches
from longstraw.tasks.runtime import config_digest


def _prefill(config: RunConfig, prompts, digest: str):
    """One task run per shard (cached), a progress artifact that moves with them, then commit."""
    total = sum(p.num_shards for p in prompts) or 1
    progress = create_progress_artifact(0.0, description="prefill shards of this step")
    done = 0
    reports = []
    for prompt in prompts:
        for shard in range(prompt.num_shards):
            prefill_prompt_shard(config, prompt, shard, digest)
            done += 1
            update_progress_artifact(progress, 100.0 * done / total)
        reports.append(commit_prompt_state(config, prompt))
    return reports


@flow(name="grpo_step", log_prints=False)
def grpo_step(config: RunConfig) -> StepMetrics:
    """Prefill → rollout → advantages → (reference / old log-probs) → backward → reduce → update."""
    logger = get_run_logger()
    digest = config_digest(config)
    prompts = plan_step(config)
    reports = _prefill(config, prompts, digest)
    rollouts = [rollout_group(config, prompt) for prompt in prompts]
    plan = compute_advantages(config, rollouts)
    refs = (
        [score_branches(config, r, "reference") for r in rollouts]
        if config.grpo.beta > 0
        else [None] * len(rollouts)
    )
    olds = (
        [score_branches(config, r, "old") for r in rollouts]
        if config.grpo.num_iterations > 1
        else [None] * len(rollouts)
    )
    update = None
    grads = []
    for iteration in range(config.grpo.num_iterations):
        if iteration > 0:
            # New weights: the prompt states of the new version (prefill tasks, cached per version).
            reports += _prefill(config, plan_step(config), digest)
        grads = [
            backward_group(
                config,
                rollout,
                plan.advantages[g],
                plan.loss_masks[g],
                plan.num_items_in_batch,
                plan.num_sequences_in_batch,
                ref_logprobs=refs[g],
                old_logprobs=olds[g],
            )
            for g, rollout in enumerate(rollouts)
        ]
        total = reduce_gradients(grads)
        update = apply_update(
            config, total, final_of_step=iteration == config.grpo.num_iterations - 1
        )
    metrics = summarize_step(
        config,
        rollouts,
        plan,
        grads,
        update,
        sum(r.shards_computed for r in reports),
        sum(r.shards_reused for r in reports),
    )
    write_checkpoint(config)
    row = metrics.model_dump(mode="json", exclude={"seconds"}) | {
        f"seconds_{k}": round(v, 3) for k, v in metrics.seconds.items()
    }
    create_table_artifact(
        [row], key=f"{_key(config.run_id)}-step", description=f"step {metrics.step}"
    )
    logger.info(
        "step %d: reward %.3f ± %.3f, loss %.4f, grad norm %.3f, version %d",
        metrics.step,
        metrics.reward_mean,
        metrics.reward_std,
        metrics.loss,
        metrics.grad_norm,
        update.policy_version,
    )
    return metrics


def _key(run_id: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in run_id.lower())
