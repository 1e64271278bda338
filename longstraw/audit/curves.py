"""A run's curves in the Prefect UI, redrawn from `metrics.jsonl` after every step.

The artifacts are keyed by run (`<run>-metrics`, `<run>-curves`, `<run>-reward-curve` — which
opens with what the run trains: every parameter, or LoRA adapters with their rank, targets and
trainable count —, `<run>-reward-plot`): each publication is a new version of the same key, and the UI's Artifacts
page shows the latest. They are read from the run's recorded rows, not from what one flow run
did, so a resumed run's curves start at step 0 and a run that failed keeps the steps it finished.
The reward plot travels inside the artifact as a PNG data URI (the UI shows an image artifact as
`<img src=…>`): it needs no file server.
"""

from __future__ import annotations

import base64

from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_table_artifact,
)

from longstraw.audit.names import artifact_key, metrics_row, rounded_rows
from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import run_dir
from longstraw.training.metrics import plot_rewards, policy_description, read_metrics

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


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def publish_run_curves(config: RunConfig) -> list[StepMetrics]:
    """Publish the run's metrics table, curves and reward plot from every recorded step (none
    when no step is recorded yet); returns the rows."""
    path = run_dir(config.storage, config.run_id)
    history = read_metrics(path)
    if not history:
        return history
    key = artifact_key(config.run_id)
    steps = f"steps 0-{history[-1].step}" if len(history) > 1 else "step 0"
    create_table_artifact(
        rounded_rows([metrics_row(m) for m in history]),
        key=f"{key}-metrics",
        description=f"run {config.run_id}: per-step GRPO metrics, {steps} (4 significant digits)",
    )
    create_table_artifact(
        curve_rows(history),
        key=f"{key}-curves",
        description=f"run {config.run_id}: reward and loss per step, {steps}",
    )
    create_markdown_artifact(
        f"Policy: {policy_description(config, history)}\n\n{reward_curve_markdown(history)}",
        key=f"{key}-reward-curve",
    )
    plot = plot_rewards(path, history)
    create_image_artifact(
        png_data_uri(plot.read_bytes()),
        key=f"{key}-reward-plot",
        description=f"run {config.run_id}: mean reward ± std per step, {steps} ({plot.name})",
    )
    return history
