"""The exact sweep's checkpoints in a run: keyed, stored, timed, on every rank of the stage.

`backward_group` hands the engine a `StoredSweepCheckpoints` (the engine's `SweepCheckpoints`,
`engine.sweep_checkpoint`): its checkpoints go to `storage.sweep_checkpoints` under the run's
policy version and the group, keyed by everything the backward depends on (`sweep_key`). On
ranks every rank of the stage calls it at the same shard: the stage's writer decides and
commits, each rank writes and reads its own part, and every rank hears the same answer.

When one is due: after every `engine.sweep_checkpoint_every` shards, or after the first shard
that ends `engine.sweep_checkpoint_seconds` after the previous checkpoint (or the sweep's start)
and at least `OVERHEAD_FACTOR` times as long after it as that checkpoint took to write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch.distributed as dist

from longstraw.distributed.stage_group import (
    active_group,
    from_writer,
    is_writer,
    stage_control,
    stage_ranks,
)
from longstraw.schemas.refs import PolicyRef, RolloutRef, ScoresRef
from longstraw.schemas.results import AdvantagePlan
from longstraw.schemas.run import RunConfig
from longstraw.schemas.storage import SweepCheckpointManifest, SweepKey
from longstraw.storage.errors import StateIntegrityError
from longstraw.storage.sweep_checkpoints import (
    SweepCheckpointStore,
    digest_json,
    remove_sweep_checkpoints,
)
from longstraw.training import progress

logger = logging.getLogger("longstraw.sweep")

OVERHEAD_FACTOR = 20
"""A checkpoint by time waits at least 20 times as long as the previous one took to write: the
writes cost at most 1/20 = 5 % of the sweep however slow the storage is."""


def sweep_key(
    config: RunConfig,
    policy: PolicyRef,
    rollout: RolloutRef,
    plan: AdvantagePlan,
    group: int,
    ref_scores: ScoresRef | None,
    old_scores: ScoresRef | None,
    iteration: int,
) -> SweepKey:
    """What `backward_group`'s result depends on (its arguments and the settings that change
    the numbers), as a sweep checkpoint's key."""
    prompt = rollout.prompt
    engine = config.engine
    parallel = config.parallel
    return SweepKey(
        run_id=config.run_id,
        policy_version=policy.policy_version,
        weights_digest=policy.weights_digest,
        prompt_digest=prompt.prompt_digest,
        num_shards=prompt.num_shards,
        group=prompt.index,
        iteration=iteration,
        responses=rollout.digest,
        advantages=digest_json(
            [
                plan.advantages[group],
                plan.loss_masks[group],
                plan.num_items_in_batch,
                plan.num_sequences_in_batch,
                None if ref_scores is None else ref_scores.digest,
                None if old_scores is None else old_scores.digest,
            ]
        ),
        loss_config=digest_json(config.grpo.model_dump(mode="json")),
        engine=digest_json(
            [
                engine.prompt_grad,
                engine.shard_tokens,
                engine.branch_segment_tokens,
                engine.share_response_prefixes,
            ]
        ),
        model=digest_json(config.model.model_dump(mode="json")),
        adapters=adapter_origin(config, policy),
        placement=placement(parallel.sequence_ranks, parallel.data_parallel),
    )


def adapter_origin(config: RunConfig, policy: PolicyRef) -> str | None:
    """What names a LoRA policy's adapters besides its weights digest (`SweepKey.adapters`): the
    seed they were drawn from, while the policy descends from the run's start."""
    if config.model.lora is None or not policy.checkpoint_is_run_start:
        return None
    return f"drawn from train.seed {config.train.seed}"


def placement(sequence_ranks: int, data_parallel: int) -> str:
    """How a backward's ranks are named in its key: one process, or its sequence ranks (and the
    replicas a rank's gradient rows are laid out for)."""
    if sequence_ranks == 1:
        return "1 process"
    replicas = f" of {data_parallel} replicas" if data_parallel > 1 else ""
    return f"{sequence_ranks} sequence ranks{replicas}"


def sweep_checkpoints(config: RunConfig, key: SweepKey) -> StoredSweepCheckpoints | None:
    """The backward's sweep checkpoints; None where it has none: detached mode (no sweep),
    storage off (nothing could read them back), or neither cadence set."""
    engine = config.engine
    if (
        engine.prompt_grad != "exact"
        or config.storage.persist_mode == "off"
        or (engine.sweep_checkpoint_seconds is None and engine.sweep_checkpoint_every is None)
    ):
        return None
    return StoredSweepCheckpoints(config, key)


def discard_sweep_checkpoints(config: RunConfig, policy: PolicyRef, group: int) -> None:
    """Remove what is left of group `group`'s sweep checkpoints at `policy`'s version: its
    backward's result is recorded (`training.finished_groups`)."""
    if config.storage.persist_mode != "off":
        remove_sweep_checkpoints(config.storage, config.run_id, policy.policy_version, group)


def _gathered(value) -> list:
    """`value` of every rank running the stage, in rank order (one process: [value])."""
    if active_group() is None:
        return [value]
    values = [None] * stage_ranks()[1]
    dist.all_gather_object(values, value, group=stage_control())
    return values


class StoredSweepCheckpoints:
    """`engine.sweep_checkpoint.SweepCheckpoints` over storage, for one backward stage."""

    def __init__(
        self, config: RunConfig, key: SweepKey, clock: Callable[[], float] = time.monotonic
    ):
        self.store = SweepCheckpointStore(config.storage, key)
        self.key = key
        self.every = config.engine.sweep_checkpoint_every
        self.seconds = config.engine.sweep_checkpoint_seconds
        self.clock = clock
        self.since = clock()
        self.last_write_s = 0.0
        self.rank, self.ranks = stage_ranks()
        self.committed: list[int] = []
        """`swept` of each checkpoint this stage committed, in order."""
        self.write_seconds: list[float] = []
        """Seconds each took, on this rank (writing its part, and on the writer committing)."""
        self.bytes_written: list[int] = []
        """Bytes of this rank's part of each."""
        self.committed_at: list[float] = []
        """`clock()` when each was committed (written, on ranks, by every rank)."""

    # ---------------------------------------------------------------- resuming
    def latest(self) -> _Found | None:
        manifest = from_writer(self._matching() if is_writer() else None)
        return None if manifest is None else _Found(self, manifest)

    def _matching(self) -> SweepCheckpointManifest | None:
        """The latest committed checkpoint if it is this backward's; any other is named in one
        line and removed (its position would block this sweep's own)."""
        committed = self.store.committed()
        if not committed:
            return None
        try:
            manifest = self.store.read_marker(committed[-1])
        except StateIntegrityError as error:
            self._start_over(committed[-1], f"is damaged ({error})")
            return None
        difference = manifest.key.first_difference(self.key)
        if difference is None and len(manifest.parts) != self.ranks:
            difference = f"it has {len(manifest.parts)} parts for {self.ranks} ranks"
        if difference is not None:
            self._start_over(committed[-1], f"is of another backward: {difference}")
            return None
        return manifest

    def _start_over(self, swept: int, problem: str) -> None:
        logger.warning(
            "warning: sweep checkpoint %s %s; the sweep of group %d starts over",
            self.store.marker_uri(swept),
            problem,
            self.key.group,
        )
        self.store.remove(*self.store.committed())

    # ---------------------------------------------------------------- committing
    def due(self, swept: int) -> bool:
        if self.every is not None and swept % self.every == 0:
            due = True
        elif self.seconds is not None:
            waited = self.clock() - self.since
            due = waited >= max(self.seconds, OVERHEAD_FACTOR * self.last_write_s)
        else:
            due = False
        # The writer's clock decides for every rank: each rank's own could disagree.
        return from_writer(due) if self.ranks > 1 else due

    def save(self, swept: int, tensors, record: dict) -> None:
        started = self.clock()
        attempt = from_writer(self.store.new_attempt() if is_writer() else None)
        part = self.store.write_part(attempt, self.rank, self.ranks, tensors)
        parts = _gathered(part)
        if is_writer():
            self.store.commit(attempt, swept, parts, record)
        self.committed.append(swept)
        self.bytes_written.append(part.num_elements * 4)
        self.committed_at.append(self.clock())
        self.last_write_s = self.committed_at[-1] - started
        self.write_seconds.append(self.last_write_s)
        self.since = self.clock()


class _Found:
    """A committed checkpoint of this backward, as the engine's `StoredSweep`."""

    def __init__(self, owner: StoredSweepCheckpoints, manifest: SweepCheckpointManifest):
        self.owner = owner
        self.manifest = manifest
        self.swept = manifest.swept
        self.record = manifest.record

    def read_into(self, tensors) -> bool:
        owner = self.owner
        try:
            owner.store.read_part(self.manifest, owner.rank, tensors)
            problem = None
        except (StateIntegrityError, FileNotFoundError) as error:
            problem = f"rank {owner.rank}: {error}" if owner.ranks > 1 else str(error)
        problems = [p for p in _gathered(problem) if p is not None]
        if problems:
            if is_writer():
                owner._start_over(self.swept, f"is damaged ({problems[0]})")
            return False
        return True


def sweep_progress(group: int) -> Callable[[int, int, int], None]:
    """The engine's `on_sweep_shard` of a group's backward: "sweep_shard" progress events
    (group, done, total, resumed) from the stage's writer, told to the driver."""

    def told(done: int, total: int, resumed: int) -> None:
        if is_writer():
            progress.emit_to_driver("sweep_shard", group, done=done, total=total, resumed=resumed)

    return told
