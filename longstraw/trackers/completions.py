"""A step's table of sampled completions: prompt digest, completion text (cut), reward and
advantage of the first responses of its groups, kept beside the step's rollout records
(`steps/<step>/completions.json`) until the trackers and the Prefect UI
(`audit.completions`) show it."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from longstraw.schemas.refs import RolloutRecord
from longstraw.schemas.run import RunConfig
from longstraw.storage.artifacts import step_dir

COMPLETIONS_FILE = "completions.json"
COLUMNS = ("group", "prompt_id", "prompt_digest", "sample", "completion", "reward", "advantage")
DIGEST_CHARS = 12
"""Characters of the prompt's sha256 digest shown (enough to tell a run's prompts apart)."""


def cut(text: str, chars: int) -> str:
    """`text` cut to at most `chars` characters, the cut marked with `…`."""
    return text if len(text) <= chars else text[: chars - 1] + "…"


def completion_rows(
    records: list[RolloutRecord], advantages: list[list[float]], rows: int, chars: int
) -> list[list]:
    """The first `rows` responses of the step, group by group, one row of COLUMNS each
    (`advantages` [groups][G], the step's plan). A group is numbered by its prompt's run-wide
    index, as the task runs of its prefill, rollout and backward name it."""
    out = []
    for record, group_advantages in zip(records, advantages, strict=True):
        for sample, (text, reward, advantage) in enumerate(
            zip(record.texts, record.rewards, group_advantages, strict=True)
        ):
            if len(out) == rows:
                return out
            out.append(
                [
                    record.prompt.index,
                    record.prompt.prompt_id,
                    record.prompt.prompt_digest[:DIGEST_CHARS],
                    sample,
                    cut(text, chars),
                    float(reward),
                    float(advantage),
                ]
            )
    return out


def completions_path(config: RunConfig, step: int) -> Path:
    return step_dir(config.storage, config.run_id, step) / COMPLETIONS_FILE


def write_completions(
    config: RunConfig, step: int, records: list[RolloutRecord], advantages: list[list[float]]
) -> None:
    """Keep step `step`'s table (`tracking.completions_per_step` rows) for the trackers and the
    Prefect UI."""
    rows = completion_rows(
        records,
        advantages,
        config.tracking.completions_per_step,
        config.tracking.completion_chars,
    )
    path = completions_path(config, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps({"columns": list(COLUMNS), "data": rows}))
    os.replace(tmp, path)


def read_completions(config: RunConfig, step: int) -> tuple[list[str], list[list]] | None:
    """(columns, rows) of step `step`'s table; None where none was kept."""
    path = completions_path(config, step)
    if not path.is_file():
        return None
    table = json.loads(path.read_text())
    return table["columns"], table["data"]
