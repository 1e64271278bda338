"""The `train` flow: steps of `grpo_step` with checkpoints, resume and the run's audit artifacts."""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from longstraw.flows.grpo_step import _key, grpo_step
from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig
from longstraw.tasks.plan import open_run_task


def reward_curve_markdown(history: list[StepMetrics]) -> str:
    """A markdown table and a text sparkline of mean reward per step."""
    bars = "▁▂▃▄▅▆▇█"
    values = [m.reward_mean for m in history]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    spark = "".join(bars[int((v - low) / span * (len(bars) - 1))] for v in values)
    lines = [
        "# Reward curve",
        "",
        f"`{spark}`  (min {low:.3f}, max {high:.3f})",
        "",
        "| step | version | reward mean | reward std | loss | grad norm |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {m.step} | {m.policy_version} | {m.reward_mean:.4f} | {m.reward_std:.4f} | {m.loss:.5f} | {m.grad_norm:.4f} |"
        for m in history
    ]
    return "\n".join(lines)


@flow(name="longstraw-train")
def train(config: RunConfig, resume: bool = False) -> list[StepMetrics]:
    """Run `config.train.num_steps` GRPO steps (continuing after the latest checkpoint with resume)."""
    logger = get_run_logger()
    start = open_run_task(config, resume)
    if start.step:
        logger.info(
            "resuming run %s at step %d (policy version %d)",
            config.run_id,
            start.step,
            start.policy_version,
        )
    history = []
    for _ in range(start.step, config.train.num_steps):
        history.append(grpo_step(config))
    if history:
        key = _key(config.run_id)
        create_table_artifact(
            [m.model_dump(mode="json", exclude={"seconds"}) for m in history],
            key=f"{key}-metrics",
            description="per-step GRPO metrics",
        )
        create_markdown_artifact(reward_curve_markdown(history), key=f"{key}-reward-curve")
    return history
