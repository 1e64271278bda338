"""How this process holds the run's policy: whole, or its rows of a policy sharded over the ranks.

One process holds the policy whole (`WholePolicy`). On several ranks (`parallel.world_size > 1`)
every rank holds 1/W of each parameter at rest, the matching fp32 AdamW state and masters, and
its rows of every stored gradient (`ShardedPolicy`: FSDP2, `distributed.sharded_policy`; the
rows are `distributed.gradient_slices`'). The stages and the run context read one
`PolicyStorage`, chosen once where the policy is loaded (`hold_policy`), for everything that
differs between the two:

* `gather` — the weights ready to compute (an all-gather when sharded);
* `store_gradient` — a gradient file of the stage: whole, or this rank's part of it;
* `step_gradient` — the sum of the step's group contributions, this process's rows of it;
* `apply` — one optimizer step from a stored step gradient;
* `load_optimizer` / `write_checkpoint` — the optimizer's state from a committed checkpoint,
  and a committed checkpoint of the weights and the optimizer.

A LoRA policy is the same storage over fewer trainable parameters: the optimizer, the gradient
rows and a checkpoint's optimizer state cover the adapters alone, and its checkpoint holds the
adapters (`models.lora`). torchtitan keeps the train loop the same way: the model is
parallelised once, and the loop steps an optimizer container and a checkpointer that hide
whether the parameters are sharded.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.replica_gradients import sum_over_replicas, zero_replica_rows
from longstraw.distributed.sharded_policy import (
    ShardedWeights,
    full_state_dict,
    local_shards,
    shard_policy,
)
from longstraw.distributed.stage_group import (
    active_group,
    active_topology,
    is_writer,
    stage_control,
    stage_ranks,
    when_ranks_stop,
)
from longstraw.grpo.grad_buffer import GradBuffer
from longstraw.grpo.optim import PolicyOptimizer, UpdateStats
from longstraw.schemas.refs import CheckpointRef, GradPart, GradRef
from longstraw.schemas.run import RunConfig
from longstraw.storage import artifacts
from longstraw.storage.checkpoints import (
    checkpoint_path,
    checkpoint_ref,
    commit_checkpoint,
    load_optimizer_rows,
    new_checkpoint_dir,
    save_optimizer_part,
    save_training_checkpoint,
)


@dataclass(frozen=True)
class CheckpointContents:
    """What a checkpoint of run `config.run_id` holds beside the weights and optimizer state."""

    config: RunConfig
    policy_version: int
    tokenizer: object
    trainer_state: dict
    """`trainer_state.json`: the step, the run's config, the step's metrics row."""
    base_weights_digest: str | None = None
    """A LoRA policy: the digest of the base its adapters train on (the checkpoint holds the
    adapters alone)."""


class PolicyStorage(Protocol):
    """Where this process's part of the policy lives, and how it computes, steps and saves."""

    model: PreTrainedModel
    optimizer: PolicyOptimizer
    """AdamW over what this process steps: every trainable parameter, or its rows of each."""

    def gather(self) -> None:
        """Make `model`'s parameters whole for computing (collective when sharded)."""

    def load_optimizer(self, path: Path) -> None:
        """The optimizer state of committed checkpoint `path` (this process's rows of it)."""

    def store_gradient(
        self, path: Path, grads: dict[str, torch.Tensor], *, policy_version: int, num_tokens: int
    ) -> GradRef:
        """Store `grads` (this process's rows) as the stage's gradient at `path`; its ref."""

    def step_gradient(self, grads: list[GradRef]) -> GradBuffer:
        """This process's rows of the sum of the step's group contributions `grads`."""

    def apply(self, update: GradRef) -> UpdateStats:
        """One optimizer step from the stored step gradient `update`."""

    def write_checkpoint(self, checkpoint: CheckpointContents) -> CheckpointRef | None:
        """Commit `checkpoint` with these weights and this optimizer's state (collective when
        sharded); its ref on the process that writes the stage's files, None on the others."""


def hold_policy(model: PreTrainedModel, config: RunConfig) -> PolicyStorage:
    """The storage of the loaded `model`: whole in one process, sharded over the ranks of the
    run's stage group (collective there: every rank, same model)."""
    num_steps = config.train.num_steps * config.grpo.num_iterations
    if active_group() is None:
        return WholePolicy(model, PolicyOptimizer(model, config.grpo, num_steps=num_steps))
    return ShardedPolicy.over_ranks(model, config, num_steps=num_steps)


def _summed(refs: list[GradRef], device: torch.device, part: int | None) -> GradBuffer:
    """The sum of stored gradients `refs` (their part `part`), in the order given."""
    total = GradBuffer.from_tensors(
        {n: t.clone() for n, t in artifacts.read_grads(refs[0], device, rank=part).items()}
    )
    for other in refs[1:]:
        total.add_(GradBuffer.from_tensors(artifacts.read_grads(other, device, rank=part)))
    return total


class WholePolicy:
    """The policy whole in this process: every parameter, gradient and optimizer row."""

    def __init__(self, model: PreTrainedModel, optimizer: PolicyOptimizer):
        self.model = model
        self.optimizer = optimizer

    def gather(self) -> None:
        pass

    def load_optimizer(self, path: Path) -> None:
        self.optimizer.load_state_tensors(load_optimizer_rows(path))

    def store_gradient(
        self, path: Path, grads: dict[str, torch.Tensor], *, policy_version: int, num_tokens: int
    ) -> GradRef:
        return artifacts.write_grads(
            path, grads, policy_version=policy_version, num_tokens=num_tokens
        )

    def step_gradient(self, grads: list[GradRef]) -> GradBuffer:
        return _summed(grads, self.model.device, None)

    def apply(self, update: GradRef) -> UpdateStats:
        return self.optimizer.apply(
            GradBuffer.from_tensors(artifacts.read_grads(update, self.model.device))
        )

    def write_checkpoint(self, checkpoint: CheckpointContents) -> CheckpointRef:
        return save_training_checkpoint(
            checkpoint.config.storage,
            checkpoint.config.run_id,
            policy_version=checkpoint.policy_version,
            model=self.model,
            tokenizer=checkpoint.tokenizer,
            optimizer_tensors=self.optimizer.state_tensors(),
            trainer_state=checkpoint.trainer_state,
            base_weights_digest=checkpoint.base_weights_digest,
        )


class ShardedPolicy:
    """This rank's rows of a policy sharded at rest over every rank of the run (global rank g
    holds FSDP chunk g of each parameter): its optimizer steps those rows, and a stored gradient
    is one file per rank."""

    def __init__(self, model: PreTrainedModel, weights: ShardedWeights, optimizer: PolicyOptimizer):
        self.model = model
        self.weights = weights
        self.optimizer = optimizer

    @classmethod
    def over_ranks(cls, model: PreTrainedModel, config: RunConfig, *, num_steps: int):
        """Shard `model` over the run's ranks and build the optimizer of this rank's rows."""
        weights = shard_policy(model, active_topology())
        optimizer = PolicyOptimizer.over_local_shards(
            local_shards(model),
            config.grpo,
            num_steps=num_steps,
            sum_over_ranks=weights.sum_over_ranks,
        )
        return cls(model, weights, optimizer)

    @property
    def rank(self) -> int:
        """g: the chunk of each parameter this rank holds (its part of a step gradient)."""
        return self.weights.layout.seq_rank

    def gather(self) -> None:
        self.weights.gather()

    def load_optimizer(self, path: Path) -> None:
        self.optimizer.load_state_tensors(
            load_optimizer_rows(path, lambda key, dim0: self.weights.rows(dim0))
        )

    def store_gradient(
        self, path: Path, grads: dict[str, torch.Tensor], *, policy_version: int, num_tokens: int
    ) -> GradRef:
        """Each rank running the stage stores its own rows (`GradRef.parts`, in the order of
        those ranks: a replica's, or the run's)."""
        index, count = stage_ranks()
        mine = artifacts.write_grads(
            artifacts.rank_path(path, index, count),
            grads,
            policy_version=policy_version,
            num_tokens=num_tokens,
        )
        parts: list = [None] * count
        dist.all_gather_object(
            parts, GradPart(uri=mine.uri, digest=mine.digest), group=stage_control()
        )
        replica = active_group().scope()
        return mine.model_copy(
            update={"parts": tuple(parts), "replica": 0 if replica is None else replica.index}
        )

    def step_gradient(self, grads: list[GradRef]) -> GradBuffer:
        """This replica's groups summed (its sequence rank's rows of each; zeros where the
        replica ran none: fewer groups in the step than replicas), then added across the
        replicas: each rank keeps its FSDP chunk's rows (collective over every rank)."""
        device, topology = self.model.device, active_topology()
        mine = [g for g in grads if g.replica == topology.replica]
        if mine:
            total = _summed(mine, device, topology.sequence_rank)
        else:
            total = GradBuffer.from_tensors(zero_replica_rows(self.model, topology, device))
        if topology.replicas == 1:
            return total
        return GradBuffer.from_tensors(
            sum_over_replicas(self.model, total.grads, topology, active_group().data_group)
        )

    def apply(self, update: GradRef) -> UpdateStats:
        # The optimizer steps the shards in place; the next stage that computes gathers them.
        self.weights.to_rest()
        return self.optimizer.apply(
            GradBuffer.from_tensors(artifacts.read_grads(update, self.model.device, rank=self.rank))
        )

    def write_checkpoint(self, checkpoint: CheckpointContents) -> CheckpointRef | None:
        """Each rank writes its optimizer rows into the temporary directory rank 0 made, rank 0
        the gathered weights, then commits (the ranks share the checkpoint directory's
        filesystem)."""
        config, control = checkpoint.config, active_group().control
        final = checkpoint_path(config.storage, config.run_id, checkpoint.policy_version)
        chosen = [None]
        if is_writer():
            # A retried stage: the first complete write stands.
            chosen = [None if final.exists() else str(new_checkpoint_dir(final))]
        dist.broadcast_object_list(chosen, src=0, group=control)
        if chosen[0] is None:
            return checkpoint_ref(final) if is_writer() else None
        tmp = Path(chosen[0])
        try:
            save_optimizer_part(
                tmp, self.optimizer.state_tensors(), self.rank, config.parallel.world_size
            )
            # A LoRA policy's checkpoint holds its adapters alone: only they are copied.
            weights = full_state_dict(
                self.model,
                self.weights,
                copy=is_writer(),
                trainable_only=checkpoint.base_weights_digest is not None,
            )
            dist.barrier(group=control)
        except BaseException:
            # A rank's failed write (a full disk on its node) fails this rank's collectives too:
            # the temporary directory goes, as a single process's failed write removes its own —
            # once the ranks are stopped, since another rank may still be writing its rows into
            # it.
            if is_writer():
                when_ranks_stop(lambda: shutil.rmtree(tmp, ignore_errors=True))
            raise
        if not is_writer():
            return None
        return commit_checkpoint(
            tmp,
            final,
            policy_version=checkpoint.policy_version,
            model=self.model,
            tokenizer=checkpoint.tokenizer,
            trainer_state=checkpoint.trainer_state,
            state_dict=weights,
            base_weights_digest=checkpoint.base_weights_digest,
        )
