"""Everything a training run holds between steps, and how a run is opened or resumed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from longstraw.engine.state import PrefixState
from longstraw.grpo.optim import PolicyOptimizer
from longstraw.models.checkpoint import load_checkpoint, read_checkpoint_metadata
from longstraw.models.factory import init_model
from longstraw.schemas.results import StepMetrics
from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import (
    latest_checkpoint,
    load_training_state,
    local_root,
    run_dir,
)
from longstraw.training.prompts import prompt_source

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class RunContext:
    """A training run in memory: model, optimizer, data, RNG and progress."""

    config: RunConfig
    model: PreTrainedModel
    tokenizer: object
    optimizer: PolicyOptimizer
    source: object
    generator: torch.Generator
    """Sampling RNG (saved in every checkpoint so a resumed run draws the same responses)."""
    checkpoint_digest: str
    """Weights digest of the last checkpoint written or loaded (hashed once at write time)."""
    checkpoint_version: int
    """Policy version of that checkpoint."""
    step: int = 0
    """Rollout steps completed."""
    policy_version: int = 0
    """Optimizer updates applied so far."""
    reference_model: PreTrainedModel | None = None
    reference_digest: str | None = None
    reference_states: dict[str, PrefixState] = field(default_factory=dict)
    """Reference prompt states by prompt digest, kept in memory when storage.persist_mode is off
    (otherwise storage holds them): the reference never changes, so each prompt is prefilled once
    per run. Memory: one state per distinct prompt."""
    history: list[StepMetrics] = field(default_factory=list)

    @property
    def weights_digest(self) -> str:
        """Identity of the current weights, for keying prompt states.

        The checkpoint's own digest when the current version was checkpointed; otherwise a digest
        derived from (last checkpoint digest, current version): weights are never re-hashed per step.
        """
        if self.policy_version == self.checkpoint_version:
            return self.checkpoint_digest
        return hashlib.sha256(
            f"{self.checkpoint_digest}:{self.policy_version}".encode()
        ).hexdigest()

    @property
    def run_path(self) -> Path:
        return run_dir(self.config.storage, self.config.run_id)


def initial_checkpoint(config: RunConfig) -> Path:
    """The checkpoint a fresh run starts from; builds the configured tiny/small model once."""
    if config.model.checkpoint is not None:
        return Path(config.model.checkpoint)
    m = config.model
    path = (
        local_root(config.storage) / "models" / f"{m.init_family}-{m.init_size}-seed{m.init_seed}"
    )
    if not (path / "longstraw.json").exists():
        init_model(m.init_family, m.init_size, path, seed=m.init_seed)
    return path


def open_run(config: RunConfig, *, resume: bool = False) -> RunContext:
    """Load the starting weights (or, with `resume`, the latest committed checkpoint of the run)."""
    dtype = _DTYPES[config.model.dtype]
    start = latest_checkpoint(config.storage, config.run_id) if resume else None
    if resume and start is None:
        raise ValueError(
            f"--resume: run {config.run_id!r} has no committed checkpoint under "
            f"{run_dir(config.storage, config.run_id)}; start it without --resume"
        )
    path = start or initial_checkpoint(config)
    model, tokenizer, meta = load_checkpoint(path, dtype=dtype)
    model.train(
        False
    )  # no dropout in these families; eval() keeps transformers off train-only paths
    for p in model.parameters():
        p.requires_grad_(True)
    torch.manual_seed(config.train.seed)
    generator = torch.Generator().manual_seed(config.train.seed)
    optimizer = PolicyOptimizer(
        model, config.grpo, num_steps=config.train.num_steps * config.grpo.num_iterations
    )
    ctx = RunContext(
        config=config,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        source=prompt_source(config.data, tokenizer),
        generator=generator,
        checkpoint_digest=meta.weights_digest,
        checkpoint_version=meta.policy_version,
        policy_version=meta.policy_version,
    )
    if start is not None:
        optimizer_tensors, rng, trainer_state = load_training_state(start)
        optimizer.load_state_tensors(optimizer_tensors)
        generator.set_state(rng["sampling"])
        torch.set_rng_state(rng["torch"])
        ctx.step = int(trainer_state["step"])
        ctx.history = [StepMetrics.model_validate(m) for m in trainer_state.get("history", [])]
    if config.grpo.beta > 0:
        ref_path = Path(config.model.reference_checkpoint or initial_checkpoint(config))
        reference, _, ref_meta = load_checkpoint(ref_path, dtype=dtype)
        reference.requires_grad_(False)
        ctx.reference_model = reference
        ctx.reference_digest = (
            read_checkpoint_metadata(ref_path).weights_digest or ref_meta.weights_digest
        )
    return ctx
