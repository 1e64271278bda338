"""MLflow: a SQLite tracking store under `runs/<run_id>/trackers/mlflow` (MLflow's file store is
refused by MLflow 3 unless opted into), or the store MLFLOW_TRACKING_URI names. A resumed run
continues the same MLflow run (its id is kept beside the store)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from longstraw.schemas.run import RunConfig
from longstraw.trackers.tracker import Held, recall, remember, tracker_dir

TABLES = "tables"
"""Artifact folder of the tables: `tables/<name>/step_<step>.json` (MLflow's log_table layout:
`columns` and `data`)."""
RUN_ID_FILE = "run_id.json"


def local_tracking_uri(directory: Path) -> str:
    return f"sqlite:///{directory / 'mlflow.db'}"


@contextlib.contextmanager
def _quiet():
    """MLflow's and alembic's INFO lines (creating the store's tables) kept off the console."""
    loggers = [logging.getLogger(name) for name in ("mlflow", "alembic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def table_artifact(name: str, step: int) -> str:
    return f"{TABLES}/{name}/step_{step:06d}.json"


def read_mlflow(client, run_id: str) -> Held:
    """step -> metric keys and table names MLflow run `run_id` holds."""
    held: Held = {}
    for key in client.get_run(run_id).data.metrics:
        for metric in client.get_metric_history(run_id, key):
            held.setdefault(metric.step, set()).add(key)
    for folder in client.list_artifacts(run_id, TABLES):
        name = Path(folder.path).name
        for file in client.list_artifacts(run_id, folder.path):
            step = int(Path(file.path).stem.removeprefix("step_"))
            held.setdefault(step, set()).add(name)
    return held


class MlflowTracker:
    name = "mlflow"

    def __init__(self, config: RunConfig) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        directory = tracker_dir(config, self.name)
        user_uri = os.environ.get("MLFLOW_TRACKING_URI")
        uri = user_uri or local_tracking_uri(directory)
        with _quiet():
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(config.tracking.project)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(
                    config.tracking.project,
                    # With the local store the artifacts sit beside it, not in the cwd.
                    artifact_location=None if user_uri else (directory / "artifacts").as_uri(),
                )
            )
        id_file = directory / RUN_ID_FILE
        self.run_id = None
        kept = recall(id_file)
        if kept is not None and kept["uri"] == uri:
            # A run deleted from the store since: a new one is started.
            with contextlib.suppress(MlflowException):
                self.run_id = self.client.get_run(kept["id"]).info.run_id
        if self.run_id is None:
            run = self.client.create_run(
                experiment_id,
                run_name=config.run_id,
                tags={"longstraw.run_id": config.run_id},
            )
            self.run_id = run.info.run_id
            self.client.log_dict(self.run_id, config.model_dump(mode="json"), "config.json")
            remember(id_file, id=self.run_id, uri=uri)
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        self._held = read_mlflow(self.client, self.run_id)

    def logged(self) -> Held:
        return self._held

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.client.log_dict(
            self.run_id, {"columns": columns, "data": rows}, table_artifact(name, step)
        )

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if not metrics:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()]
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
