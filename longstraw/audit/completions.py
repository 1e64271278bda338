"""A run's sampled completions in the Prefect UI: one version of `<run>-completions` per step.

Each version is one step's table, the rows the trackers' completions table gets
(`trackers.completions`, kept beside the step's rollout records) with the step in front and
every float to 4 significant digits, as the UI's other tables. The UI's artifact page shows the
latest step and, under its history, every step before it.

Published like the curves (`curves.py`): after every step and after a failure, from the run's
recorded steps (`metrics.jsonl`), not from what one flow run did. So a step recorded before a
failure keeps its table, and a resumed run publishes the recorded steps whose table the Prefect
API lacks before its own. Each recorded step gets one version, across failures and resumes: the
versions the API already holds are the ledger (read once when the flow opens it), and a step
redone after a lost checkpoint, which draws the same responses, is not published again.
"""

from __future__ import annotations

import json

from prefect.artifacts import create_table_artifact

from longstraw.audit.names import artifact_key, rounded_rows
from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig
from longstraw.trackers.completions import read_completions

PAGE = 200
"""Artifacts read per request (the Prefect API's default page limit)."""


def completions_key(run_id: str) -> str:
    return f"{artifact_key(run_id)}-completions"


def completions_table(step: int, columns: list[str], rows: list[list]) -> list[dict]:
    """A step's stored table as the UI's rows: `step`, then the trackers' columns."""
    return rounded_rows([{"step": step, **dict(zip(columns, row, strict=True))} for row in rows])


def published_steps(key: str) -> set[int]:
    """The steps the Prefect API holds a version of `key` for (every row of a version names its
    step)."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    steps: set[int] = set()
    with get_client(sync_client=True) as client:
        offset = 0
        while True:
            page = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                limit=PAGE,
                offset=offset,
            )
            for artifact in page:
                steps.update(_steps_of(artifact.data))
            if len(page) < PAGE:
                return steps
            offset += PAGE


def _steps_of(data) -> set[int]:
    """The steps a version's rows name; none for data that is not such a table (another
    writer's artifact under the key hides no step)."""
    try:
        rows = json.loads(data) if isinstance(data, str) else data
    except ValueError:
        return set()
    if not isinstance(rows, list):
        return set()
    return {
        row["step"] for row in rows if isinstance(row, dict) and isinstance(row.get("step"), int)
    }


class RunCompletions:
    """The `<run>-completions` artifact of one run, as one flow run publishes it."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.key = completions_key(config.run_id)
        self.published = (
            published_steps(self.key) if config.tracking.completions_per_step else set()
        )

    def publish(self, history: list[StepMetrics]) -> None:
        """A version for each recorded step of `history` the API has none for, in step order
        (none where the step kept no table: `tracking.completions_per_step: 0`)."""
        if not self.config.tracking.completions_per_step:
            return
        for metrics in history:
            if metrics.step in self.published:
                continue
            table = read_completions(self.config, metrics.step)
            if table is None:
                continue
            rows = completions_table(metrics.step, *table)
            create_table_artifact(
                rows,
                key=self.key,
                description=(
                    f"run {self.config.run_id}: step {metrics.step}, {len(rows)} sampled "
                    f"completions (text cut to {self.config.tracking.completion_chars} "
                    "characters, 4 significant digits)"
                ),
            )
            self.published.add(metrics.step)
