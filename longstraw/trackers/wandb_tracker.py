"""Weights & Biases, always offline: run files under `runs/<run_id>/trackers/wandb` (`wandb sync`
uploads them later). A resumed run logs to the same W&B run id, in a new offline directory."""

from __future__ import annotations

import uuid

from longstraw.schemas.run import RunConfig
from longstraw.trackers.tracker import Held, recall, remember, tracker_dir
from longstraw.trackers.wandb_files import history

RUN_ID_FILE = "run_id.json"
TABLE_TYPE_SUFFIX = "/_type"


def read_wandb(directory, run_id: str) -> Held:
    """step -> keys and table names of the history rows W&B run `run_id` wrote."""
    held: Held = {}
    for step, values in history(directory, run_id):
        names = held.setdefault(step, set())
        for key in values:
            names.add(key.removesuffix(TABLE_TYPE_SUFFIX))
    return held


class WandbTracker:
    name = "wandb"

    def __init__(self, config: RunConfig) -> None:
        import wandb

        directory = tracker_dir(config, self.name)
        kept = recall(directory / RUN_ID_FILE)
        self.run_id = kept["id"] if kept is not None else uuid.uuid4().hex[:12]
        if kept is None:
            remember(directory / RUN_ID_FILE, id=self.run_id)
        self._held = read_wandb(directory, self.run_id)
        self.run = wandb.init(
            project=config.tracking.project,
            name=config.run_id,
            id=self.run_id,
            dir=str(directory),
            resume="allow",
            mode="offline",
            config=config.model_dump(mode="json"),
            settings=wandb.Settings(
                silent=True,
                console="off",
                disable_git=True,
                save_code=False,
                x_disable_stats=True,
            ),
        )
        self._tables: dict = {}

    def logged(self) -> Held:
        return self._held

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        import wandb

        self._tables[name] = wandb.Table(columns=columns, data=rows)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        # One history row per step, its table included: written whole or not at all.
        self.run.log({**metrics, **self._tables}, step=step, commit=True)
        self._tables = {}

    def close(self) -> None:
        self.run.finish()
