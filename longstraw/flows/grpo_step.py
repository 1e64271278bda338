"""The `grpo_step` flow: one GRPO step, the composition of `training.step.run_step` over tasks."""

from __future__ import annotations

from prefect import flow, get_run_logger, tags
from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from longstraw.audit.names import (
    artifact_key,
    metrics_row,
    rounded_rows,
    step_flow_run_name,
    step_tags,
)
from longstraw.schemas.refs import PolicyRef
from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig
from longstraw.tasks.stages import prefect_stages
from longstraw.training.step import run_step


def _step_run_name() -> str:
    from prefect.runtime import flow_run

    # The bound parameters: models in the process that called the flow, JSON mappings when read
    # back from the API.
    config, policy = flow_run.parameters["config"], flow_run.parameters["policy"]
    run_id = config["run_id"] if isinstance(config, dict) else config.run_id
    step = policy["step"] if isinstance(policy, dict) else policy.step
    return step_flow_run_name(run_id, step)


@flow(name="grpo_step", flow_run_name=_step_run_name, log_prints=False)
def grpo_step(config: RunConfig, policy: PolicyRef) -> tuple[PolicyRef, StepMetrics]:
    """Prefill → rollout → advantages → (reference / old log-probs) → backward → reduce → update
    → checkpoint; returns the new policy and the step's record."""
    logger = get_run_logger()
    progress = create_progress_artifact(0.0, description="prefill shards of this step")

    def on_prefill_shard(done: int, total: int) -> None:
        update_progress_artifact(progress, 100.0 * done / max(total, 1))

    with tags(*step_tags(config.run_id, policy.step, policy.policy_version)):
        policy, metrics = run_step(config, policy, prefect_stages(on_prefill_shard))
    row = metrics_row(metrics) | {f"seconds_{k}": v for k, v in metrics.seconds.items()}
    create_table_artifact(
        rounded_rows([row]),
        key=f"{artifact_key(config.run_id)}-step",
        description=f"step {metrics.step}",
    )
    logger.info(
        "step %d: reward %.3f ± %.3f, loss %.4f, grad norm %.3f, version %d",
        metrics.step,
        metrics.reward_mean,
        metrics.reward_std,
        metrics.loss,
        metrics.grad_norm,
        policy.policy_version,
    )
    if metrics.eval is not None:
        logger.info(
            "step %d: eval reward %.3f ± %.3f over %d held-out prompts (version %d)",
            metrics.step,
            metrics.eval.reward_mean,
            metrics.eval.reward_std,
            metrics.eval.num_prompts,
            metrics.eval.policy_version,
        )
    return policy, metrics
