"""Trackio: its SQLite project database under `runs/<run_id>/trackers/trackio` (TRACKIO_DIR),
the Trackio run named after the LongStraw run and continued on resume."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

from longstraw.errors import UserError
from longstraw.schemas.run import RunConfig
from longstraw.trackers.tracker import Held, tracker_dir

TABLE_TYPE = "trackio.table"


def read_trackio(project: str, run_name: str) -> Held:
    """step -> keys (tables included) of the rows Trackio holds for `run_name`."""
    from trackio.sqlite_storage import SQLiteStorage

    held: Held = {}
    for row in SQLiteStorage.get_logs(project, run_name):
        held.setdefault(row["step"], set()).update(
            key for key in row if key not in ("step", "timestamp")
        )
    return held


def use_trackio_dir(directory: Path) -> None:
    """Point Trackio at `directory`: it reads TRACKIO_DIR once, when it is first imported."""
    if "trackio" in sys.modules:
        from trackio import utils

        if Path(utils.TRACKIO_DIR).resolve() != directory.resolve():
            raise UserError(
                f"trackio already logs to {utils.TRACKIO_DIR} in this process and reads its "
                f"directory once — train run {directory.parent.parent.name!r} in its own process "
                "(longstraw train does)"
            )
        return
    os.environ["TRACKIO_DIR"] = str(directory)


class TrackioTracker:
    name = "trackio"

    def __init__(self, config: RunConfig) -> None:
        use_trackio_dir(tracker_dir(config, self.name))
        import trackio

        self.project, self.run_name = config.tracking.project, config.run_id
        self._held = read_trackio(self.project, self.run_name)
        with contextlib.redirect_stdout(io.StringIO()):  # its banner would break the progress bars
            self.run = trackio.init(
                project=self.project,
                name=self.run_name,
                resume="allow",
                config=config.model_dump(mode="json"),
                embed=False,
                auto_log_cpu=False,
                auto_log_gpu=False,
            )
        self._tables: dict = {}

    def logged(self) -> Held:
        return self._held

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        import trackio

        self._tables[name] = trackio.Table(columns=columns, data=rows)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, **self._tables}, step=step)
        self._tables = {}

    def close(self) -> None:
        import trackio

        # trackio.finish, not run.finish: it also forgets the run, so that its exit hook does
        # not finish it a second time (and print to the console after the summary).
        with contextlib.redirect_stdout(io.StringIO()):
            trackio.finish()
