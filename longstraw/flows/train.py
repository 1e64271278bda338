"""The `train` flow: steps of `grpo_step` with checkpoints, resume and the run's audit artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from longstraw.distributed.stage_group import start_stage_group
from longstraw.errors import UserError
from longstraw.flows.grpo_step import artifact_key, grpo_step
from longstraw.orchestration.names import rounded_rows
from longstraw.orchestration.stages import open_run
from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig, validated_run_config
from longstraw.storage.checkpoints import latest_checkpoint
from longstraw.storage.config_files import read_run_config
from longstraw.training.loop import after_step
from longstraw.training.metrics import settle_metrics
from longstraw.training.preflight import preflight
from longstraw.training.run_lease import run_lease

CURVE_COLUMNS = ("step", "policy_version", "reward_mean", "reward_std", "loss", "grad_norm")
"""The reward and loss curves: one row per step, these columns."""


def curve_rows(history: list[StepMetrics]) -> list[dict]:
    """Reward and loss per step, floats to 4 significant digits (a table the UI shows as is)."""
    return rounded_rows([m.model_dump(mode="json", include=set(CURVE_COLUMNS)) for m in history])


def reward_curve_markdown(history: list[StepMetrics]) -> str:
    """The reward and loss curves as a markdown table, 4 significant digits."""
    lines = [
        "# Reward and loss per step",
        "",
        "| step | version | reward mean | reward std | loss | grad norm |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        "| "
        + " | ".join(
            f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in CURVE_COLUMNS
        )
        + " |"
        for row in curve_rows(history)
    ]
    return "\n".join(lines)


def run_config(config: dict[str, Any] | None, config_file: str | None) -> RunConfig:
    """The run's config: `config_file` (a path or URI) with `config` merged onto it as overrides,
    or `config` alone (every unset field at its default)."""
    if config_file is not None:
        return read_run_config(config_file, config or {})
    return validated_run_config(config or {}, "flow parameter `config`")


def refuse_restart(config: RunConfig, resume: bool) -> None:
    """A run that has a committed checkpoint is continued (`resume`), never restarted over."""
    if not resume and (found := latest_checkpoint(config.storage, config.run_id)) is not None:
        raise UserError(
            f"run {config.run_id!r} already has a committed checkpoint ({found}) — run it with "
            "resume=true to continue it, or choose another run_id"
        )


def train_run_name() -> str:
    """The flow run's name in the UI: the run id (`r1`, `r1 resumed`), or the config file's name
    when the run id comes from the file."""
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    config = parameters.get("config") or {}
    run_id = config.get("run_id") if isinstance(config, dict) else None
    name = run_id or Path(parameters.get("config_file") or "longstraw-train").stem
    return f"{name} resumed" if parameters.get("resume") else name


@flow(name="longstraw-train", flow_run_name=train_run_name)
def train(
    config: dict[str, Any] | None = None, resume: bool = False, config_file: str | None = None
) -> list[StepMetrics]:
    """Run `num_steps` GRPO steps (continuing after the latest checkpoint with `resume`).

    `config_file` names a YAML run config (a path or URI: in the image, on a volume, in S3);
    `config` holds overrides merged onto it section by section (`{"run_id": "x"}` changes the
    run id and nothing else), or the whole config when there is no file.
    """
    logger = get_run_logger()
    config = run_config(config, config_file)
    preflight(config, resume)
    with run_lease(config):
        refuse_restart(config, resume)
        start_stage_group(config.parallel)
        policy = open_run(config, resume)
        settle_metrics(config.storage, policy)
        if policy.step:
            logger.info(
                "resuming run %s at step %d (policy version %d)",
                config.run_id,
                policy.step,
                policy.policy_version,
            )
        history = []
        while policy.step < config.train.num_steps:
            policy, metrics = grpo_step(config, policy)
            history.append(metrics)
            after_step(config, metrics)
    if history:
        key = artifact_key(config.run_id)
        create_table_artifact(
            rounded_rows([m.model_dump(mode="json", exclude={"seconds"}) for m in history]),
            key=f"{key}-metrics",
            description="per-step GRPO metrics (4 significant digits)",
        )
        create_table_artifact(
            curve_rows(history), key=f"{key}-curves", description="reward and loss per step"
        )
        create_markdown_artifact(reward_curve_markdown(history), key=f"{key}-reward-curve")
    return history
