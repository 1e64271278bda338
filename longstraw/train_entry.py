"""`longstraw train`: the embedded default and configured runs, with rich progress output.

With no Prefect server configured (no PREFECT_API_URL), flows run on Prefect's ephemeral local
API with a project-local PREFECT_HOME (./.longstraw/prefect), a start-up timeout long enough for
a 2-core machine and analytics off. These variables must be set before Prefect is imported.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from longstraw.schemas.run import RunConfig, load_run_config

console = Console()


def configure_prefect_environment(project_dir: Path) -> None:
    """Embedded-default Prefect settings (only where the user has not set their own)."""
    home = project_dir / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home))
    # Prefect's default 20 s is too short for a first start (a fresh database) on a busy machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(home / "results"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def resolve_config(
    config_path: Path | None,
    *,
    steps: int | None,
    run_id: str | None,
    root: str | None,
    resume: bool,
    world_size: int | None = None,
) -> RunConfig:
    overrides: dict = {}
    if run_id is not None:
        overrides["run_id"] = run_id
    config = load_run_config(config_path, **overrides) if config_path else RunConfig(**overrides)
    updates: dict = {}
    if steps is not None:
        updates["train"] = config.train.model_copy(update={"num_steps": steps})
    if root is not None:
        updates["storage"] = config.storage.model_copy(update={"root_uri": root})
    if world_size is not None:
        updates["parallel"] = config.parallel.model_copy(update={"world_size": world_size})
    if updates:
        config = RunConfig.model_validate(
            config.model_dump() | {k: v.model_dump() for k, v in updates.items()}
        )
    from longstraw.storage.checkpoints import latest_checkpoint

    exists = latest_checkpoint(config.storage, config.run_id) is not None
    if exists and not resume:
        if config_path is None and run_id is None:
            # The embedded demo never collides with an earlier demo run: give it a fresh id.
            stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
            return config.model_copy(update={"run_id": f"{config.run_id}-{stamp}"})
        raise ValueError(
            f"run {config.run_id!r} already has checkpoints under {config.storage.root_uri}: pass "
            "--resume to continue it, or choose another --run-id"
        )
    return config


def summary_table(history) -> Table:
    table = Table(title="LongStraw training summary")
    # Short headers: the table must fit an 80-column terminal (and CI logs) untruncated.
    # "shards" is computed/reused prefill shards.
    for column in (
        "step",
        "ver",
        "reward",
        "std",
        "loss",
        "|grad|",
        "P tok",
        "shards",
        "sec",
    ):
        table.add_column(column, justify="right", no_wrap=True)
    for m in history:
        table.add_row(
            str(m.step),
            str(m.policy_version),
            f"{m.reward_mean:.3f}",
            f"{m.reward_std:.3f}",
            f"{m.loss:+.4f}",
            f"{m.grad_norm:.3f}",
            str(m.prompt_tokens),
            f"{m.shards_computed}/{m.shards_reused}",
            f"{sum(m.seconds.values()):.1f}",
        )
    return table


def run_training(
    *,
    config_path: Path | None,
    resume: bool,
    steps: int | None,
    run_id: str | None,
    root: str | None,
    world_size: int | None = None,
    use_prefect: bool = True,
) -> list:
    configure_prefect_environment(Path.cwd() / ".longstraw")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = resolve_config(
        config_path, steps=steps, run_id=run_id, root=root, resume=resume, world_size=world_size
    )
    console.print(
        f"[bold]LongStraw[/bold] run [cyan]{config.run_id}[/cyan]: {config.train.num_steps} steps × "
        f"{config.train.groups_per_step} groups × G={config.grpo.num_generations}, prompt_grad="
        f"{config.engine.prompt_grad}, storage {config.storage.root_uri}"
    )
    from longstraw.distributed.stage_group import start_stage_group, stop_stage_group
    from longstraw.training import progress as events

    # Under torchrun, every rank but 0 serves the stages from here and exits when rank 0 is done;
    # without it, rank 0 starts the other ranks on this machine.
    start_stage_group(config.parallel)
    started = time.perf_counter()
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        steps_bar = progress.add_task("GRPO steps", total=config.train.num_steps)
        shards_bar = progress.add_task("prefill shards", total=None)

        def listen(event: str, fields: dict) -> None:
            if event == "prefill_shard":
                progress.update(shards_bar, total=fields["total"], completed=fields["done"])
            elif event == "step":
                progress.update(steps_bar, completed=fields["step"] + 1)

        events.add_listener(listen)
        try:
            if use_prefect:
                from longstraw.flows.train import train as train_flow

                console.print(
                    "[dim]starting Prefect (ephemeral local API unless PREFECT_API_URL is set)…[/dim]"
                )
                history = train_flow(config.model_dump(mode="json"), resume=resume)
            else:
                from longstraw.training.loop import train

                history = train(config, resume=resume).history
        finally:
            events.remove_listener(listen)
            stop_stage_group()
        progress.update(steps_bar, completed=config.train.num_steps)
    console.print(summary_table(history))
    from longstraw.storage.checkpoints import latest_checkpoint

    console.print(
        f"finished in {time.perf_counter() - started:.0f} s; latest checkpoint: "
        f"{latest_checkpoint(config.storage, config.run_id)}"
    )
    return history
