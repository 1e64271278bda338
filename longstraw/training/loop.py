"""The training loop without Prefect: steps, checkpoints, metrics JSONL and the reward plot."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from longstraw.schemas.refs import CheckpointRef
from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import save_training_checkpoint
from longstraw.training.context import RunContext, open_run
from longstraw.training.step import run_step

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward.png"


def save_checkpoint(ctx: RunContext) -> CheckpointRef:
    """Commit a checkpoint of the current policy version with optimizer and RNG state."""
    ref = save_training_checkpoint(
        ctx.config.storage,
        ctx.config.run_id,
        policy_version=ctx.policy_version,
        model=ctx.model,
        tokenizer=ctx.tokenizer,
        optimizer_tensors=ctx.optimizer.state_tensors(),
        rng_tensors={"sampling": ctx.generator.get_state(), "torch": torch.get_rng_state()},
        trainer_state={
            "step": ctx.step,
            "policy_version": ctx.policy_version,
            "run_id": ctx.config.run_id,
            "config": ctx.config.model_dump(mode="json"),
            "history": [m.model_dump(mode="json") for m in ctx.history],
        },
    )
    ctx.checkpoint_digest, ctx.checkpoint_version = ref.weights_digest, ref.policy_version
    return ref


def append_metrics(run_path: Path, metrics: StepMetrics) -> None:
    run_path.mkdir(parents=True, exist_ok=True)
    with open(run_path / METRICS_FILE, "a") as handle:
        handle.write(metrics.model_dump_json() + "\n")


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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def is_checkpoint_step(ctx: RunContext) -> bool:
    cfg = ctx.config.train
    return ctx.step % cfg.checkpoint_every == 0 or ctx.step >= cfg.num_steps


def train(
    config: RunConfig,
    *,
    resume: bool = False,
    on_step: Callable[[RunContext, StepMetrics], None] | None = None,
) -> RunContext:
    """Run (or resume) training to `config.train.num_steps` steps in this process."""
    ctx = open_run(config, resume=resume)
    if not resume:
        # A fresh run starts a fresh metrics file.
        (ctx.run_path / METRICS_FILE).unlink(missing_ok=True)
    while ctx.step < config.train.num_steps:
        metrics = run_step(ctx)
        append_metrics(ctx.run_path, metrics)
        if is_checkpoint_step(ctx):
            save_checkpoint(ctx)
            plot_rewards(ctx.run_path, ctx.history)
        if on_step is not None:
            on_step(ctx, metrics)
    return ctx


def read_metrics(run_path: Path) -> list[StepMetrics]:
    path = run_path / METRICS_FILE
    if not path.exists():
        return []
    return [
        StepMetrics.model_validate(json.loads(line))
        for line in path.read_text().splitlines()
        if line
    ]
