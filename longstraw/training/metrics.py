"""A run's per-step metrics: `metrics.jsonl` keyed by step, and the reward plot beside it.

A step's row is written once it is done; a step that runs again (a resumed run re-doing a step
whose checkpoint was lost, a retried flow) replaces its row and drops the rows after it, which
belonged to the abandoned attempt. The file is rewritten whole through a rename, so a reader
never sees half a row and no step appears twice.

A checkpoint's `trainer_state.json` holds the row of the step that made it (`step_record`):
`settle_metrics` puts it back when a process died between the checkpoint's commit and the row's
write, so every checkpointed step has its row exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path

from longstraw.schemas.refs import PolicyRef
from longstraw.schemas.results import StepMetrics
from longstraw.schemas.storage import StorageConfig
from longstraw.storage.checkpoints import TRAINER_STATE, run_dir

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward.png"
STEP_RECORD_KEY = "step_record"
"""Key of the checkpointed step's metrics row in a checkpoint's trainer_state.json."""


def policy_description(config, history: list[StepMetrics]) -> str:
    """What the run trains, in one line: every parameter, or LoRA adapters (rank, alpha, target
    modules), with the trainable parameter count the steps recorded."""
    counts = [m.trainable_parameters for m in history if m.trainable_parameters is not None]
    count = f", {counts[-1]:,} trainable parameters" if counts else ""
    lora = config.model.lora
    if lora is None:
        return f"full-parameter training{count}"
    targets = (
        lora.target_modules
        if isinstance(lora.target_modules, str)
        else ", ".join(lora.target_modules)
    )
    return f"LoRA r={lora.r}, lora_alpha={lora.lora_alpha:g} on {targets}{count}"


def read_metrics(run_path: Path) -> list[StepMetrics]:
    """The recorded steps, in step order."""
    path = run_path / METRICS_FILE
    if not path.exists():
        return []
    rows = [
        StepMetrics.model_validate(json.loads(line))
        for line in path.read_text().splitlines()
        if line
    ]
    return sorted(rows, key=lambda m: m.step)


def write_step_metrics(storage: StorageConfig, run_id: str, metrics: StepMetrics) -> None:
    """Record step `metrics.step`: rows before it are kept, its own and later ones replaced."""
    run_path = run_dir(storage, run_id)
    _write_rows(run_path, [m for m in read_metrics(run_path) if m.step < metrics.step] + [metrics])


def truncate_metrics(storage: StorageConfig, run_id: str, steps_done: int) -> None:
    """Keep only the rows of steps < `steps_done` (a run restarting from a checkpoint)."""
    run_path = run_dir(storage, run_id)
    if (run_path / METRICS_FILE).exists():
        _write_rows(run_path, [m for m in read_metrics(run_path) if m.step < steps_done])


def settle_metrics(storage: StorageConfig, policy: PolicyRef) -> None:
    """Where run `policy.run_id` (re)starts, `policy.step` steps done: drop the rows of later
    steps, and restore the checkpointed step's row from the checkpoint when it is missing."""
    truncate_metrics(storage, policy.run_id, policy.step)
    if policy.checkpoint_is_run_start or policy.step == 0:
        return
    run_path = run_dir(storage, policy.run_id)
    rows = read_metrics(run_path)
    if any(m.step == policy.step - 1 for m in rows):
        return
    start = Path(policy.checkpoint.uri.removeprefix("file://"))
    trainer_state = json.loads((start / TRAINER_STATE).read_text())
    if STEP_RECORD_KEY in trainer_state:
        record = StepMetrics.model_validate(trainer_state[STEP_RECORD_KEY])
        _write_rows(run_path, sorted([*rows, record], key=lambda m: m.step))


def _write_rows(run_path: Path, rows: list[StepMetrics]) -> None:
    run_path.mkdir(parents=True, exist_ok=True)
    tmp = run_path / f"{METRICS_FILE}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text("".join(m.model_dump_json() + "\n" for m in rows))
        os.replace(tmp, run_path / METRICS_FILE)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk: no partial copy left behind
            tmp.unlink(missing_ok=True)
        raise


def plot_rewards(run_path: Path, history: list[StepMetrics]) -> Path | None:
    """reward.png beside the checkpoints: mean reward (± std) per step."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m.step for m in history]
    mean = [m.reward_mean for m in history]
    std = [m.reward_std for m in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, mean, marker="o", label="reward mean")
    ax.fill_between(
        steps,
        [a - b for a, b in zip(mean, std, strict=True)],
        [a + b for a, b in zip(mean, std, strict=True)],
        alpha=0.2,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = run_path / PLOT_FILE
    tmp = run_path / f"{PLOT_FILE}.tmp-{uuid.uuid4().hex[:8]}.png"
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)  # a reader never sees half a plot
    finally:
        plt.close(fig)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return path
