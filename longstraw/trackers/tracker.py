"""The interface every tracker module implements, and where its files live."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Protocol

from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import run_dir

Held = dict[int, set[str]]
"""step -> the metric and table names a tracker already holds at that step."""


class Tracker(Protocol):
    """One experiment tracker's run, opened for a LongStraw run (continuing the tracker's run
    of an earlier process of it where the tracker allows)."""

    name: str

    def logged(self) -> Held:
        """What the tracker's own files hold already (read back when it was opened): the
        run's ledger, so that no metric is logged twice at one step."""
        ...

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        """A table of step `step` (called before that step's `log_metrics`)."""
        ...

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """The numbers of step `step`; this ends the step (what the tracker buffers is written)."""
        ...

    def close(self) -> None: ...


def tracker_dir(config: RunConfig, name: str) -> Path:
    """`runs/<run_id>/trackers/<name>`: the tracker's files for this run."""
    path = run_dir(config.storage, config.run_id) / "trackers" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def recall(path: Path) -> dict | None:
    """What `remember` stored at `path` (a tracker's run id for this LongStraw run), or None."""
    return json.loads(path.read_text()) if path.is_file() else None


def remember(path: Path, **fields: str) -> None:
    """Store `fields` at `path`, whole or not at all."""
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(fields))
    os.replace(tmp, path)


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """`rows` as a markdown table (TensorBoard's text plugin renders it)."""

    def cell(value) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
