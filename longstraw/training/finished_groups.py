"""What a step's groups finished, recorded so that a resumed run does not compute it again.

A group's rollout, scores and backward each end in refs (`RolloutRef`, `ScoresRef`,
`BackwardResult`) whose files the stage wrote. After the stage returns, the driver records the
refs under the step's folder (a `Record`: read before the stage runs, written after), keyed by
everything the stage's result depends on: the run config, the policy (version and weights
digest) and the stage's inputs. A run killed mid-step — a rank or a whole data-parallel replica
gone — and started again with `--resume` redoes the step from its checkpoint; each group stage
first looks here, and a group whose rollout and backward had finished is taken as it was (its
files checked), so only the unfinished groups run again.

Nothing here is trusted blindly: a record whose key differs (another config, other weights) or
whose files are gone or rewritten is ignored, and the stage runs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from pydantic import BaseModel

from longstraw.schemas.refs import BackwardResult, GradRef, PolicyRef, RolloutRef, ScoresRef
from longstraw.schemas.run import RunConfig
from longstraw.storage import artifacts

Result = TypeVar("Result", bound=BaseModel)


def record_path(config: RunConfig, policy: PolicyRef, name: str) -> Path:
    return artifacts.step_dir(config.storage, config.run_id, policy.step) / "finished" / name


def _key(config: RunConfig, policy: PolicyRef, inputs: list) -> str:
    payload = {
        "config": config.model_dump(mode="json"),
        "policy": [policy.policy_version, policy.weights_digest, policy.step],
        "inputs": [x.model_dump(mode="json") if isinstance(x, BaseModel) else x for x in inputs],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _files(result: BaseModel) -> list[str]:
    """The file URIs a stage's result names (all must still exist for it to be reused)."""
    if isinstance(result, BackwardResult):
        return _grad_files(result.grad)
    if isinstance(result, RolloutRef | ScoresRef):
        return [result.uri]
    return []


def _grad_files(grad: GradRef) -> list[str]:
    return [part.uri for part in grad.parts] if grad.parts else [grad.uri]


def _present(uri: str) -> bool:
    return Path(uri.removeprefix("file://")).exists()


@dataclass(frozen=True)
class Record(Generic[Result]):
    """Where one group stage's result is recorded in the step's folder, and the key it must
    match: `read()` before the stage runs, `write(result)` after."""

    path: Path
    key: str
    model: type[Result]

    def read(self) -> tuple[bool, Result | None]:
        """(found, result): the recorded result where this step already finished the stage with
        the same inputs (and its files are there); (False, None) where the stage must run."""
        if self.path.exists():
            try:
                (recorded,) = json.loads(self.path.read_text())
                if recorded["key"] == self.key:
                    body = recorded["result"]
                    result = None if body is None else self.model(**body)
                    if result is None or all(_present(uri) for uri in _files(result)):
                        return True, result
            except (OSError, ValueError, KeyError, TypeError):
                pass  # a damaged record is no record: the stage runs
        return False, None

    def write(self, result: Result | None) -> Result | None:
        """`result`, recorded."""
        body = {
            "key": self.key,
            "result": None if result is None else result.model_dump(mode="json"),
        }
        artifacts.write_json(self.path, [body])
        return result


def _record(config: RunConfig, policy: PolicyRef, name: str, inputs: list, model) -> Record:
    return Record(record_path(config, policy, f"{name}.json"), _key(config, policy, inputs), model)


def rollout(config, policy, prompt) -> Record[RolloutRef]:
    return _record(config, policy, f"g{prompt.index}-rollout", [prompt], RolloutRef)


def scores(config, policy, rollout_ref, which: str) -> Record[ScoresRef]:
    index = rollout_ref.prompt.index
    return _record(config, policy, f"g{index}-scores-{which}", [rollout_ref, which], ScoresRef)


def backward(config, policy, rollout_ref, plan, ref_scores, old_scores, iteration) -> Record:
    index = rollout_ref.prompt.index
    inputs = [rollout_ref, plan, ref_scores, old_scores, iteration]
    name = f"g{index}-i{iteration}-backward"
    return _record(config, policy, name, inputs, BackwardResult)
