"""The run's trackers, opened once from `tracking.report_to`, and each recorded step logged to
them exactly once.

Exactly once, across `--resume` too, the way metrics.jsonl is: the tracker's own files are the
ledger. When a tracker is opened it reads back what it already holds (step -> names); the
recorded rows of metrics.jsonl it lacks are logged then (a row restored from a checkpoint, a
step whose process died between its row and the tracker), and a step that runs again after
a lost checkpoint logs only what the tracker does not hold yet. So each (name, step) pair is
written once: where the tracker kept an abandoned attempt of a step, that attempt's numbers
stand (a re-run step draws the same responses from the same weights; only its seconds differ).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from longstraw.errors import UserError
from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig
from longstraw.trackers.completions import read_completions
from longstraw.trackers.metric_names import tracker_metrics
from longstraw.trackers.tracker import Held, Tracker

COMPLETIONS_TABLE = "completions"


@dataclass(frozen=True)
class TrackerModule:
    module: str
    """The LongStraw module of the tracker, and its class."""
    cls: str
    package: str
    """The module the tracker's package provides (what preflight looks for)."""
    pip: str
    """What to install."""


TRACKERS: dict[str, TrackerModule] = {
    "tensorboard": TrackerModule(
        "longstraw.trackers.tensorboard_tracker", "TensorBoardTracker", "tensorboard", "tensorboard"
    ),
    "mlflow": TrackerModule(
        "longstraw.trackers.mlflow_tracker", "MlflowTracker", "mlflow", "mlflow-skinny"
    ),
    "wandb": TrackerModule("longstraw.trackers.wandb_tracker", "WandbTracker", "wandb", "wandb"),
    "trackio": TrackerModule(
        "longstraw.trackers.trackio_tracker", "TrackioTracker", "trackio", "trackio"
    ),
}


def check_trackers(config: RunConfig) -> None:
    """Each tracker `tracking.report_to` names has its package installed."""
    for name in config.tracking.report_to:
        spec = TRACKERS[name]
        if importlib.util.find_spec(spec.package) is None:
            raise UserError(
                f"tracking.report_to names {name} but the {spec.package} package is not "
                f"installed — pip install {spec.pip} (or pip install 'longstraw[trackers]' for "
                f"every tracker), or remove {name} from tracking.report_to"
            )


def open_tracker(name: str, config: RunConfig) -> Tracker:
    spec = TRACKERS[name]
    return getattr(importlib.import_module(spec.module), spec.cls)(config)


class RunTrackers:
    """The open trackers of one run and what each already holds."""

    def __init__(self, config: RunConfig, trackers: list[Tracker]) -> None:
        self.config = config
        self.trackers = trackers
        self.held: dict[str, Held] = {t.name: t.logged() for t in trackers}

    def log_step(self, metrics: StepMetrics) -> None:
        """Log step `metrics.step` (its numbers and its completions table) to every tracker,
        all but what the tracker holds already at that step."""
        if not self.trackers:
            return
        values = tracker_metrics(metrics, agent=self.config.agent is not None)
        table = (
            read_completions(self.config, metrics.step)
            if self.config.tracking.completions_per_step
            else None
        )
        for tracker in self.trackers:
            held = self.held[tracker.name].setdefault(metrics.step, set())
            new = {k: v for k, v in values.items() if k not in held}
            with_table = table is not None and COMPLETIONS_TABLE not in held
            if not new and not with_table:
                continue
            if with_table:
                tracker.log_table(metrics.step, COMPLETIONS_TABLE, *table)
                held.add(COMPLETIONS_TABLE)
            tracker.log_metrics(metrics.step, new)
            held.update(new)


def close_all(trackers: list[Tracker]) -> None:
    """Close every tracker; the first failure is raised once all are closed."""
    errors = []
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as error:
            errors.append(error)
    if errors:
        raise errors[0]


@contextlib.contextmanager
def open_trackers(config: RunConfig, recorded: Sequence[StepMetrics]) -> Iterator[RunTrackers]:
    """The trackers of `tracking.report_to`, caught up with the run's `recorded` steps (its
    metrics file, read after `settle_metrics`), closed on exit whatever happens."""
    trackers: list[Tracker] = []
    try:
        for name in config.tracking.report_to:
            trackers.append(open_tracker(name, config))
        run = RunTrackers(config, trackers)
        for row in recorded:
            run.log_step(row)
        yield run
    finally:
        close_all(trackers)
