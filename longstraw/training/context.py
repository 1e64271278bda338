"""A run's policy in memory, where a run starts, and how a process rebuilds a `PolicyRef`."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from longstraw.errors import UserError
from longstraw.grpo.optim import PolicyOptimizer
from longstraw.models.checkpoint import load_checkpoint, read_checkpoint_metadata
from longstraw.models.factory import init_model
from longstraw.models.hub import resolve_checkpoint
from longstraw.models.lora import is_lora_checkpoint, load_lora, with_lora
from longstraw.schemas.refs import CheckpointRef, GradRef, PolicyRef
from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import (
    TRAINER_STATE,
    checkpoint_ref,
    latest_valid_checkpoint,
    local_root,
    run_dir,
    run_started,
    valid_checkpoint,
)
from longstraw.training.policy_storage import PolicyStorage, hold_policy
from longstraw.training.prompts import eval_prompt_source, run_prompt_source

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class RunContext:
    """A training run's policy in memory: model, optimizer, data and where its weights came from."""

    config: RunConfig
    model: PreTrainedModel
    tokenizer: object
    policy_storage: PolicyStorage
    """Where this process holds the policy: whole, or its rows of it sharded over the run's ranks
    (`training.policy_storage`); it gathers, stores gradients, steps and checkpoints them."""
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
    reference_model: PreTrainedModel | None = None
    """The reference loaded beside the policy (`model.reference_checkpoint`, or the initial
    checkpoint of a full-parameter run) when beta > 0; None otherwise, and for a LoRA run, whose
    reference is its own base with the adapters disabled (`reference_policy`)."""
    reference_digest: str | None = None
    base_weights_digest: str | None = None
    """A LoRA run: the weights digest of the frozen base the adapters are trained on (None: every
    parameter trains)."""
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

    @property
    def optimizer(self) -> PolicyOptimizer:
        """AdamW over what this process steps (`PolicyStorage.optimizer`)."""
        return self.policy_storage.optimizer

    def gather_weights(self) -> PreTrainedModel:
        """The model, ready to compute: a sharded policy's parameters are all-gathered
        (collective; a no-op when they are, or when one process holds the policy)."""
        self.policy_storage.gather()
        return self.model

    @property
    def has_reference(self) -> bool:
        """Whether the run scores a KL reference (beta > 0)."""
        return self.reference_digest is not None

    @contextlib.contextmanager
    def reference_policy(self) -> Iterator[PreTrainedModel]:
        """The reference model for the block: the one loaded beside the policy, or a LoRA
        run's policy itself with peft's adapters disabled (the base: no second copy)."""
        if self.reference_model is not None:
            yield self.reference_model
            return
        assert self.base_weights_digest is not None and self.has_reference
        with self.model.disable_adapter():
            yield self.model

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
    updates in order (bitwise the weights of the process that made them). A LoRA run
    (`model.lora`) loads its frozen base and puts on it the adapters of its checkpoint, or fresh
    ones at the run's start."""
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
    base_digest = None
    if config.model.lora is None:
        model, tokenizer, meta = load_checkpoint(
            path, dtype=dtype, record_dir=model_records(config)
        )
        # No dropout in these families; eval() keeps transformers off train-only paths.
        model.train(False)
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        model, tokenizer, meta, base_digest = _load_lora_policy(config, policy, path, dtype)
    model.to(model_device(config))
    storage = hold_policy(model, config)
    if not policy.checkpoint_is_run_start:
        storage.load_optimizer(path)
    ctx = RunContext(
        config=config,
        model=model,
        tokenizer=tokenizer,
        policy_storage=storage,
        source=run_prompt_source(config, tokenizer),
        eval_source=eval_prompt_source(config, tokenizer),
        checkpoint=policy.checkpoint,
        checkpoint_is_run_start=policy.checkpoint_is_run_start,
        step=policy.step,
        policy_version=meta.policy_version,
        base_weights_digest=base_digest,
    )
    for update in policy.updates:
        storage.apply(update)
        ctx.policy_version += 1
        ctx.updates.append(update)
    if (ctx.policy_version, ctx.weights_digest) != (policy.policy_version, policy.weights_digest):
        raise ValueError(
            f"rebuilding run {config.run_id!r} at version {policy.policy_version} from "
            f"{path} gave version {ctx.policy_version} ({ctx.weights_digest[:12]}), not "
            f"{policy.weights_digest[:12]}: the ref does not belong to this checkpoint"
        )
    if config.grpo.beta > 0:
        _load_reference(ctx, dtype)
    return ctx


def _load_lora_policy(config: RunConfig, policy: PolicyRef, path: Path, dtype):
    """(peft model, tokenizer, metadata of `path`, the base's weights digest) of a LoRA run: its
    base (the initial checkpoint) with fresh adapters (the run's start, seeded by `train.seed`)
    or those of the run's checkpoint `path`, which must have been trained on this base with
    these `model.lora` settings."""
    base_path = initial_checkpoint(config)
    model, tokenizer, base_meta = load_checkpoint(
        base_path, dtype=dtype, record_dir=model_records(config)
    )
    model.train(False)
    if policy.checkpoint_is_run_start:
        return (
            with_lora(model, config.model.lora, seed=config.train.seed),
            tokenizer,
            base_meta,
            (base_meta.weights_digest),
        )
    if not is_lora_checkpoint(path):
        raise UserError(
            f"checkpoint {path} of run {config.run_id!r} holds a whole model, but model.lora is "
            "set — remove model.lora to continue this run, or start a new run id for LoRA"
        )
    meta = read_checkpoint_metadata(path)
    if meta.base_weights_digest != base_meta.weights_digest:
        raise UserError(
            f"checkpoint {path} holds adapters trained on a base with weights digest "
            f"{str(meta.base_weights_digest)[:12]}, but model.checkpoint {base_path} has "
            f"{base_meta.weights_digest[:12]} — point model.checkpoint at the base the run "
            "started from"
        )
    trained = json.loads((path / TRAINER_STATE).read_text())["config"]["model"].get("lora")
    if trained != config.model.lora.model_dump(mode="json"):
        raise UserError(
            f"checkpoint {path} holds adapters of model.lora {trained}, but the config now says "
            f"{config.model.lora.model_dump(mode='json')} — a run's adapters keep their "
            "settings: set model.lora back, or start a new run id"
        )
    return load_lora(model, path), tokenizer, meta, base_meta.weights_digest


def _load_reference(ctx: RunContext, dtype) -> None:
    """The KL reference (beta > 0): a LoRA run without `model.reference_checkpoint` scores its
    own base with the adapters disabled; otherwise the reference checkpoint is loaded."""
    config = ctx.config
    if ctx.base_weights_digest is not None and config.model.reference_checkpoint is None:
        ctx.reference_digest = ctx.base_weights_digest
        return
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
