"""Run stages in this process from refs given as JSON: what a task on another worker does.

`python -m longstraw.training.run_stage CALLS.json` runs each call of CALLS.json — a list of
{"stage": name, "config": RunConfig, "args": [...], "kwargs": {...}}, each argument in the JSON
form of the type the stage's signature names — and prints one JSON result per line. Before each
call the process forgets everything it holds of the run (policies, prompt states, artifacts), so
every stage starts from its refs alone, as in a fresh process.
"""

from __future__ import annotations

import inspect
import json
import sys
import typing
from pathlib import Path

from pydantic import TypeAdapter

from longstraw.schemas.run import RunConfig
from longstraw.training import stages


def call_stage(name: str, payload: dict):
    """Validate `payload` against stage `name`'s signature and call it."""
    fn = getattr(stages, name)
    target = getattr(fn, "__wrapped__", fn)
    hints = typing.get_type_hints(target)
    params = list(inspect.signature(target).parameters)
    config = RunConfig.model_validate(payload["config"])
    args = [
        TypeAdapter(hints[params[i + 1]]).validate_python(value)
        for i, value in enumerate(payload.get("args", []))
    ]
    kwargs = {
        key: TypeAdapter(hints[key]).validate_python(value)
        for key, value in payload.get("kwargs", {}).items()
    }
    return fn(config, *args, **kwargs)


def forget_everything(config: RunConfig) -> None:
    """Drop this process's caches of the run: the next stage sees only its refs and storage."""
    from longstraw.storage import artifacts, default_state_lru
    from longstraw.training import held

    held.forget_run(config.run_id)
    artifacts.forget_run(config.storage, config.run_id)
    default_state_lru.clear()


def main(argv: list[str]) -> None:
    (path,) = argv
    for call in json.loads(Path(path).read_text()):
        forget_everything(RunConfig.model_validate(call["config"]))
        result = call_stage(call["stage"], call)
        sys.stdout.write(stages.dump_result(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
