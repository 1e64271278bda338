"""A run's policy in memory, where a run starts, and how a process rebuilds a `PolicyRef`."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from longstraw.distributed.stage_group import active_group
from longstraw.engine.group import GradBuffer
from longstraw.grpo.optim import PolicyOptimizer
from longstraw.models.checkpoint import load_checkpoint, read_checkpoint_metadata
from longstraw.models.factory import init_model
from longstraw.models.hub import resolve_checkpoint
from longstraw.schemas.refs import CheckpointRef, GradRef, PolicyRef
from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import (
    TRAINER_STATE,
    checkpoint_ref,
    latest_valid_checkpoint,
    load_optimizer_rows,
    local_root,
    run_dir,
    run_started,
    valid_checkpoint,
)
from longstraw.training.prompts import eval_prompt_source, run_prompt_source

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class RunContext:
    """A training run's policy in memory: model, optimizer, data and where its weights came from."""

    config: RunConfig
    model: PreTrainedModel
    tokenizer: object
    optimizer: PolicyOptimizer
    source: object
    checkpoint: CheckpointRef
    """The committed checkpoint these weights start from (the run's start model at first)."""
    checkpoint_is_run_start: bool
    updates: list[GradRef] = field(default_factory=list)
    """Reduced gradients applied since `checkpoint`, oldest first."""
    step: int = 0
    """Rollout steps completed."""
    policy_version: int = 0
    """Optimizer updates applied so far."""
    eval_source: object | None = None
    """The held-out prompts of `eval.data` (`training.evaluation`), None without them."""
    weights: object | None = None
    """`distributed.sharded_policy.ShardedWeights` when the policy is sharded at rest over the
    run's ranks (`parallel.world_size > 1`), else None (one process holds it whole)."""
    reference_model: PreTrainedModel | None = None
    reference_digest: str | None = None
    reference_states: dict[str, object] = field(default_factory=dict)
    """Reference prompt states by prompt digest, kept in memory when storage.persist_mode is off
    (otherwise storage holds them): the reference never changes, so each prompt is prefilled once
    per run. Memory: one state per distinct prompt."""

    @property
    def weights_digest(self) -> str:
        """Identity of the current weights, for keying prompt states.

        The checkpoint's own digest when the current version was checkpointed; otherwise a digest
        derived from (last checkpoint digest, current version): weights are never re-hashed per step.
        """
        if self.policy_version == self.checkpoint.policy_version:
            return self.checkpoint.weights_digest
        return hashlib.sha256(
            f"{self.checkpoint.weights_digest}:{self.policy_version}".encode()
        ).hexdigest()

    def gather_weights(self) -> PreTrainedModel:
        """The model, ready to compute: a sharded policy's parameters are all-gathered
        (collective; a no-op when they are, or when one process holds the policy)."""
        if self.weights is not None:
            self.weights.gather()
        return self.model

    @property
    def rank(self) -> int | None:
        """This process's rank when the policy is sharded over ranks, else None."""
        return None if self.weights is None else self.weights.layout.seq_rank

    @property
    def run_path(self) -> Path:
        return run_dir(self.config.storage, self.config.run_id)

    def policy_ref(self) -> PolicyRef:
        """The ref another process rebuilds these weights from."""
        return PolicyRef(
            run_id=self.config.run_id,
            step=self.step,
            policy_version=self.policy_version,
            weights_digest=self.weights_digest,
            checkpoint=self.checkpoint,
            checkpoint_is_run_start=self.checkpoint_is_run_start,
            updates=tuple(self.updates),
        )


def initial_checkpoint(config: RunConfig) -> Path:
    """The checkpoint directory a fresh run starts from: `model.checkpoint` (a directory, or a
    Hugging Face model id's snapshot in the local cache); builds the configured tiny/small model
    once when it is None."""
    if config.model.checkpoint is not None:
        return resolve_checkpoint(config.model.checkpoint)
    m = config.model
    path = (
        local_root(config.storage) / "models" / f"{m.init_family}-{m.init_size}-seed{m.init_seed}"
    )
    if not (path / "longstraw.json").exists():
        init_model(m.init_family, m.init_size, path, seed=m.init_seed)
    return path


def reference_checkpoint(config: RunConfig) -> Path:
    """The reference model's directory: `model.reference_checkpoint` (a directory or a cached
    model id), else the run's initial checkpoint."""
    if config.model.reference_checkpoint is not None:
        return resolve_checkpoint(
            config.model.reference_checkpoint, field="model.reference_checkpoint"
        )
    return initial_checkpoint(config)


def model_records(config: RunConfig) -> Path:
    """Where the weights digests of users' checkpoints are recorded (their own directories may
    be read-only): beside the run's checkpoints, shared by the runs of a storage root."""
    return local_root(config.storage) / "model-records"


def model_device(config: RunConfig) -> torch.device:
    """Where this process computes: its local rank's GPU when there is one, else the CPU."""
    if config.model.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def start_policy(config: RunConfig, *, resume: bool = False) -> PolicyRef:
    """The ref of the run's starting weights: with `resume`, the newest committed checkpoint of
    the run whose files verify (none yet: the run crashed before its first checkpoint, and starts
    again from the configured model, reusing the prompt states it committed); else the
    configured (or built) model."""
    start = latest_valid_checkpoint(config.storage, config.run_id) if resume else None
    if resume and start is None and not run_started(config.storage, config.run_id):
        raise ValueError(
            f"--resume: run {config.run_id!r} has never started under "
            f"{run_dir(config.storage, config.run_id)}; start it without --resume"
        )
    if start is not None:
        step = int(json.loads((start / TRAINER_STATE).read_text())["step"])
        checkpoint = checkpoint_ref(start)
        return PolicyRef(
            run_id=config.run_id,
            step=step,
            policy_version=checkpoint.policy_version,
            weights_digest=checkpoint.weights_digest,
            checkpoint=checkpoint,
        )
    path = initial_checkpoint(config)
    meta = read_checkpoint_metadata(path, record_dir=model_records(config))
    checkpoint = CheckpointRef(
        uri=f"file://{path.resolve()}",
        weights_digest=meta.weights_digest,
        policy_version=meta.policy_version,
    )
    return PolicyRef(
        run_id=config.run_id,
        step=0,
        policy_version=meta.policy_version,
        weights_digest=meta.weights_digest,
        checkpoint=checkpoint,
        checkpoint_is_run_start=True,
    )


def load_policy(config: RunConfig, policy: PolicyRef) -> RunContext:
    """Rebuild the weights `policy` names in this process: load its checkpoint, apply its
    updates in order (bitwise the weights of the process that made them)."""
    from longstraw.storage.artifacts import read_grads

    if policy.run_id != config.run_id:
        raise ValueError(f"policy of run {policy.run_id!r} given with config of {config.run_id!r}")
    path = Path(policy.checkpoint.uri.removeprefix("file://"))
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {path} of run {config.run_id!r} does not exist; resume from the run's "
            "latest checkpoint (--resume)"
        )
    if not policy.checkpoint_is_run_start:
        valid_checkpoint(path)  # a damaged file of the run's checkpoint is named, never loaded
    dtype = _DTYPES[config.model.dtype]
    model, tokenizer, meta = load_checkpoint(path, dtype=dtype, record_dir=model_records(config))
    model.to(model_device(config))
    # No dropout in these families; eval() keeps transformers off train-only paths.
    model.train(False)
    for p in model.parameters():
        p.requires_grad_(True)
    num_steps = config.train.num_steps * config.grpo.num_iterations
    weights, rows = None, None
    if active_group() is None:
        optimizer = PolicyOptimizer(model, config.grpo, num_steps=num_steps)
    else:
        from longstraw.distributed.sharded_policy import local_shards, shard_policy

        weights = shard_policy(model)
        optimizer = PolicyOptimizer.over_local_shards(
            local_shards(model),
            config.grpo,
            num_steps=num_steps,
            sum_over_ranks=weights.sum_over_ranks,
        )

        def rows(key: str, dim0: int) -> tuple[int, int]:
            return weights.rows(dim0)

    if not policy.checkpoint_is_run_start:
        optimizer.load_state_tensors(load_optimizer_rows(path, rows))
    ctx = RunContext(
        config=config,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        source=run_prompt_source(config, tokenizer),
        eval_source=eval_prompt_source(config, tokenizer),
        checkpoint=policy.checkpoint,
        checkpoint_is_run_start=policy.checkpoint_is_run_start,
        step=policy.step,
        policy_version=meta.policy_version,
        weights=weights,
    )
    for update in policy.updates:
        grads = GradBuffer.from_tensors(read_grads(update, model_device(config), rank=ctx.rank))
        ctx.optimizer.apply(grads)
        ctx.policy_version += 1
        ctx.updates.append(update)
    if (ctx.policy_version, ctx.weights_digest) != (policy.policy_version, policy.weights_digest):
        raise ValueError(
            f"rebuilding run {config.run_id!r} at version {policy.policy_version} from "
            f"{path} gave version {ctx.policy_version} ({ctx.weights_digest[:12]}), not "
            f"{policy.weights_digest[:12]}: the ref does not belong to this checkpoint"
        )
    if config.grpo.beta > 0:
        ref_path = reference_checkpoint(config)
        reference, _, ref_meta = load_checkpoint(
            ref_path, dtype=dtype, record_dir=model_records(config)
        )
        reference.to(model_device(config))
        reference.requires_grad_(False)
        ctx.reference_model = reference
        ctx.reference_digest = (
            read_checkpoint_metadata(ref_path, record_dir=model_records(config)).weights_digest
            or ref_meta.weights_digest
        )
    return ctx
