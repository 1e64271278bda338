"""`longstraw` command line: train, init-model, merge, state …, bench ….

Heavy imports (torch, transformers, prefect) happen inside the commands, after the config and
the flags are read and validated: `--help` and a config error answer without them
(tests/test_cli_imports.py checks that none is imported).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer

from longstraw.console import cli_console

app = typer.Typer(
    name="longstraw",
    help="GRPO on million-token prompts: prefill once without autograd, replay response branches "
    "one at a time, recover the exact prompt gradient by a reverse sweep.",
    no_args_is_help=True,
    add_completion=False,
)
console = cli_console()


@app.command("init-model")
def init_model_command(
    family: Annotated[
        str, typer.Option(help="Model family: llama, qwen3, qwen3_5, qwen3_next or glm_moe_dsa.")
    ],
    out: Annotated[Path, typer.Option(help="Directory to write the Hugging Face checkpoint to.")],
    size: Annotated[
        str, typer.Option(help="tiny (tests: hidden 64) or small (benchmarks: hidden 512).")
    ] = "tiny",
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 42,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
) -> None:
    """Write a random-weight checkpoint that transformers' from_pretrained loads unchanged."""
    import torch

    from longstraw.models.factory import FAMILIES, SIZES, describe_checkpoint, init_model

    if family not in FAMILIES:
        raise typer.BadParameter(f"choose one of {', '.join(FAMILIES)}", param_hint="--family")
    if size not in SIZES:
        raise typer.BadParameter(f"choose one of {', '.join(SIZES)}", param_hint="--size")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise typer.BadParameter("choose float32 or bfloat16", param_hint="--dtype")
    path = init_model(family, size, out, seed=seed, dtype=dtypes[dtype])
    summary = describe_checkpoint(path)
    console.print(
        f"[green]wrote[/green] {path}  ({summary['model_type']}, hidden {summary['hidden_size']}, "
        f"{summary['num_hidden_layers']} layers)"
    )


@app.command("merge")
def merge_command(
    adapter: Annotated[
        Path, typer.Argument(help="A LoRA checkpoint: adapter_config.json + adapter weights.")
    ],
    out: Annotated[Path, typer.Option(help="Directory to write the merged checkpoint to.")],
    base: Annotated[
        Path | None,
        typer.Option(help="The base model (default: the one the adapter's config names)."),
    ] = None,
) -> None:
    """Merge a LoRA run's adapters into their base: a Hugging Face checkpoint that
    transformers (and `model.checkpoint`) loads as it is."""
    from longstraw.errors import UserError
    from longstraw.models.lora import merge_lora_checkpoint

    try:
        path = merge_lora_checkpoint(adapter, out, base_dir=base)
    except UserError as error:
        _error_line(str(error))
        raise typer.Exit(2) from None
    console.print(f"[green]wrote[/green] {path}  (the base with the adapters of {adapter} merged)")


CONFIG_OPTIONS: dict[str, str] = {
    "steps": "train.num_steps",
    "run_id": "run_id",
    "root": "storage.root_uri",
    "world_size": "parallel.world_size",
    "data_parallel": "parallel.data_parallel",
}
"""`longstraw train` options that set one config field each: parameter name → dotted field. They
are merged field by field onto the config (`schemas.run.command_line_config`): any of them
combine, two of one section included."""


@app.command("train")
def train_command(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(help="YAML run config (see docs/config.md); default: the embedded demo."),
    ] = None,
    resume: Annotated[
        bool, typer.Option(help="Continue from the run's latest committed checkpoint.")
    ] = False,
    steps: Annotated[int | None, typer.Option(help="Override train.num_steps.")] = None,
    run_id: Annotated[str | None, typer.Option(help="Override run_id.")] = None,
    root: Annotated[
        str | None, typer.Option(help="Override storage.root_uri (local path or s3://).")
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option(help="Override parallel.world_size (all ranks: replicas × sequence ranks)."),
    ] = None,
    data_parallel: Annotated[
        int | None,
        typer.Option(help="Override parallel.data_parallel (replicas that split a step's groups)."),
    ] = None,
    # An explicit name: a plain boolean option would also get a negation, `--no-no-prefect`.
    no_prefect: Annotated[
        bool,
        typer.Option(
            "--no-prefect", help="Run the same steps in-process without Prefect (debugging)."
        ),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option(
            help="Show the traceback of a configuration or input error (and Prefect's logs of it)."
        ),
    ] = False,
) -> None:
    """Run GRPO training. With no arguments: the embedded default (no server, local storage,
    a tiny checkpoint it builds itself, the synthetic long-context task)."""
    from longstraw.schemas.run import ConfigError, command_line_config

    flags = {
        field: ctx.params[name]
        for name, field in CONFIG_OPTIONS.items()
        if ctx.params[name] is not None
    }
    try:
        # Before torch, transformers and Prefect are imported (10-15 s on a busy 2-core machine):
        # a config error answers in about a second.
        run_config = command_line_config(config, flags)
    except ConfigError as error:
        _refuse(error, debug)
    from longstraw.errors import UserError
    from longstraw.train_entry import Interrupted, run_training, say_interrupted

    try:
        run_training(
            run_config,
            config_path=config,
            flags=flags,
            resume=resume,
            use_prefect=not no_prefect,
            debug=debug,
        )
    except Interrupted as stop:
        say_interrupted("; ".join(part.strip() for part in str(stop).splitlines()))
        raise typer.Exit(stop.exit_code) from None
    except (UserError, ConfigError) as error:
        _refuse(error, debug)


def _refuse(error: Exception, debug: bool) -> NoReturn:
    """A user error as its one line on stderr, and the exit status it carries (2: the config or
    the input; a storage fault has its own, 74, EX_IOERR); with --debug, its traceback."""
    if debug:
        raise error
    # Notes: what else the failure left to do (a lease that could not be removed).
    _error_line("; ".join([str(error), *getattr(error, "__notes__", ())]))
    raise typer.Exit(getattr(error, "exit_code", 2)) from None


@app.command("eval")
def eval_command(
    config: Annotated[
        Path, typer.Option(help="YAML run config whose eval section names the held-out prompts.")
    ],
    checkpoint: Annotated[
        Path | None,
        typer.Option(help="Evaluate this checkpoint directory instead of model.checkpoint."),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Also write the numbers as JSON here.")] = None,
    debug: Annotated[
        bool, typer.Option(help="Show the traceback of a configuration or input error.")
    ] = False,
) -> None:
    """Answer the eval section's held-out prompts with a checkpoint, without training: the
    numbers a run logs every train.eval_steps steps (greedy unless eval.do_sample)."""
    from longstraw.errors import UserError
    from longstraw.eval_entry import run_evaluation
    from longstraw.schemas.run import ConfigError

    try:
        run_evaluation(config, checkpoint, out)
    except (UserError, ConfigError) as error:
        if debug:
            raise
        _error_line(str(error))
        raise typer.Exit(getattr(error, "exit_code", 2)) from None


def _error_line(message: str, prefix: str = "error: ") -> None:
    """One line on stderr, never wrapped or marked up by rich."""
    import sys

    sys.stderr.write(prefix + "; ".join(part.strip() for part in message.splitlines()) + "\n")
    sys.stderr.flush()


def _mount_optional_apps() -> None:
    from longstraw.storage.state_commands import state_app

    app.add_typer(
        state_app, name="state", help="Inspect, verify and garbage-collect persisted prompt states."
    )
    try:
        from bench.grpo.commands import bench_app
    except ImportError:  # the benchmarks live in a checkout (bench/), not in the wheel
        return
    app.add_typer(bench_app, name="bench", help="Benchmarks against full-sequence GRPO and TRL.")


_mount_optional_apps()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
