"""`longstraw eval`: a checkpoint answers a run config's held-out prompts (its `eval` section).

The same evaluation a run makes every `train.eval_steps` steps (`training.evaluation`), on the
weights of `model.checkpoint` (or `--checkpoint`: a user's directory, or a checkpoint a run wrote)
as they are, without training and without the run's lease: the numbers before the first step
of a learning curve, a checkpoint's accuracy at another prompt length than it was trained at.
"""

from __future__ import annotations

import os
from pathlib import Path

from longstraw.console import cli_console
from longstraw.errors import UserError
from longstraw.schemas.results import EvalMetrics
from longstraw.schemas.run import RunConfig, load_run_config

console = cli_console()


def eval_config(config_path: Path, checkpoint: Path | None) -> RunConfig:
    """The run config of `config_path` with `checkpoint` as `model.checkpoint`; refused when it
    cannot be evaluated by one process."""
    overrides = {} if checkpoint is None else {"model": {"checkpoint": str(checkpoint)}}
    config = load_run_config(config_path, **overrides)
    if config.eval is None:
        raise UserError(
            f"{config_path} has no eval section — add eval: {{data: ...}} (and train.eval_steps) "
            "with the held-out prompts to answer"
        )
    if config.parallel.world_size > 1:
        raise UserError(
            f"{config_path} sets parallel.world_size {config.parallel.world_size}: longstraw eval "
            "runs in one process — set parallel.world_size: 1 in a copy of the config"
        )
    return config


def run_evaluation(config_path: Path, checkpoint: Path | None, out: Path | None) -> EvalMetrics:
    """Evaluate and print a summary line; with `out`, also write the numbers there as JSON
    (through a rename: a reader never sees half a file)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    config = eval_config(config_path, checkpoint)
    from longstraw.training.evaluation import evaluate_checkpoint
    from longstraw.training.preflight import eval_preflight

    eval_preflight(config)
    metrics = evaluate_checkpoint(config)
    console.print(
        f"eval of {config.model.checkpoint}: {metrics.num_prompts} prompts, "
        f"{metrics.num_completions} completions, reward {metrics.reward_mean:.4f} "
        f"(std {metrics.reward_std:.4f}, min {metrics.reward_min:g}, max {metrics.reward_max:g})",
        markup=False,
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        tmp.write_text(metrics.model_dump_json(indent=2))
        os.replace(tmp, out)
    return metrics
