"""The training loop without Prefect: `run_step` over the stage functions themselves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from longstraw.schemas.refs import PolicyRef
from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import run_dir
from longstraw.trackers.run_trackers import open_trackers
from longstraw.training import held
from longstraw.training.context import RunContext
from longstraw.training.metrics import plot_rewards, read_metrics
from longstraw.training.run_start import run_opened

__all__ = ["TrainOutcome", "after_step", "read_metrics", "train"]
from longstraw.training.step import IN_PROCESS, Stages, run_step


@dataclass
class TrainOutcome:
    """Where a run ended and the steps this call ran."""

    config: RunConfig
    policy: PolicyRef
    history: list[StepMetrics] = field(default_factory=list)

    @property
    def step(self) -> int:
        return self.policy.step

    @property
    def policy_version(self) -> int:
        return self.policy.policy_version

    @property
    def run_path(self) -> Path:
        return run_dir(self.config.storage, self.config.run_id)

    @property
    def checkpoint_digest(self) -> str:
        return self.policy.checkpoint.weights_digest

    def context(self) -> RunContext:
        """The run's policy in this process (rebuilt from its refs when not held)."""
        return held.policy(self.config, self.policy)


def after_step(config: RunConfig, metrics: StepMetrics) -> None:
    """After every step, redraw the reward plot from the recorded rows (the whole run's)."""
    path = run_dir(config.storage, config.run_id)
    plot_rewards(path, read_metrics(path))


def train(
    config: RunConfig,
    *,
    resume: bool = False,
    on_step: Callable[[StepMetrics], None] | None = None,
    stages: Stages = IN_PROCESS,
) -> TrainOutcome:
    """Run (or resume) training to `config.train.num_steps` steps in this process, holding the
    run's lease (one writer per run; a run with a committed checkpoint is only continued:
    `training.run_start`)."""
    with run_opened(config, resume) as (policy, recorded):
        outcome = TrainOutcome(config, policy)
        with open_trackers(config, recorded) as trackers:
            while outcome.policy.step < config.train.num_steps:
                outcome.policy, metrics = run_step(config, outcome.policy, stages)
                outcome.history.append(metrics)
                trackers.log_step(metrics)
                after_step(config, metrics)
                if on_step is not None:
                    on_step(metrics)
    return outcome
