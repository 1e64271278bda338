"""The `tracking` section: which experiment trackers receive a run's per-step metrics."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TrackerName = Literal["tensorboard", "mlflow", "wandb", "trackio"]


class TrackingConfig(BaseModel):
    """Experiment trackers (TRL's `report_to`): every recorded step's metrics, under TRL's names
    and LongStraw's own, and a table of sampled completions. Everything is written under the
    run's directory (`runs/<run_id>/trackers/`); nothing is sent over the network."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    report_to: list[TrackerName] = Field(default_factory=list)
    """Trackers to log to: any of tensorboard, mlflow, wandb, trackio (a single name or `none`
    is accepted too). Each needs its package (`pip install 'longstraw[trackers]'` installs all
    four). W&B always runs offline (upload later with `wandb sync`); MLflow writes a SQLite store
    under the run's directory unless MLFLOW_TRACKING_URI is set."""
    project: str = Field(default="longstraw", min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """The W&B project, MLflow experiment and Trackio project the run is logged under (the
    tracker's run is named after `run_id`)."""
    completions_per_step: int = Field(default=8, ge=0)
    """Rows of the sampled-completions table logged per step, to the trackers and to the
    Prefect UI (`<run>-completions`): prompt digest, completion text, reward, advantage; the
    first responses of the step's groups in order. 0: no table."""
    completion_chars: int = Field(default=200, ge=1)
    """Characters of each completion's text kept in the table (longer ones are cut, marked
    with `…`)."""

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_name_or_none(cls, value: Any) -> Any:
        if value is None or value == "none":
            return []
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("report_to")
    @classmethod
    def _each_once(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} named more than once: name each tracker once")
        return value
