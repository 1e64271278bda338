"""Sequence-sharded prefill that persists each rank's shards and resumes from the committed ones.

The single-process `PrefillSession` (longstraw/training/persisted_prefill.py) distributed over the
ranks of a sequence group, through storage's public writer API only:

* One writer per chunk: every rank opens its own writer attempt on the same state directory and
  writes only the shards it owns (their K/V chunks and end-of-shard linear checkpoints; rank 0
  also shard 0's start checkpoint). Shard manifests are created exclusively by storage, so a
  shard is recorded once whoever writes it.
* Lineage: storage lets a writer record shard k only once it knows shard k-1 as recorded. For a
  rank's first shard k0 > 0, shard k0-1 belongs to the previous rank; the rank waits for that
  manifest and reads the shard back (`read_shard`, hash-checked), and checks that its end
  linear-attention state is bitwise the state the previous rank handed over at the boundary. This
  costs one shard read per ownership boundary; storage has no public "adopt a recorded shard by
  its manifest" that would skip the bytes.
* The state-level commit stays exclusive and happens once: after every rank has its shards
  recorded (barrier), rank 0 of the group commits; COMMITTED.json is created exclusively.
* Resume: rank 0 finds the first global shard without a manifest (manifests always form a prefix:
  by lineage nobody records k before k-1) and broadcasts it; every rank reads back the owned
  shards before it (`read_shard`), the linear-state handoffs at restored ownership boundaries are
  replayed over the wire, and `sharded_prefill` computes from that shard on. Committed shards are
  never recomputed; `ShardedPrefillOutcome` counts what each rank computed and read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.sharded_prefill import allocate_sharded_state, sharded_prefill
from longstraw.distributed.wavefront_prefill import wavefront_prefill
from longstraw.engine.state import PrefixState
from longstraw.engine.state_layout import restore_shard, shard_payload, state_layout
from longstraw.engine.state_tiers import StateBudget, tiered_like
from longstraw.schemas.storage import (
    PrefixStateRef,
    StateKey,
    StorageConfig,
)
from longstraw.storage import (
    BackgroundStateWriter,
    StateKeyMismatchError,
    open_persisting_writer,
    read_manifest,
)
from longstraw.storage.paths import state_dir_uri

# How often a rank looks for the previous rank's boundary shard manifest (background writers
# record it asynchronously; synchronous ones have it before the next shard starts).
_POLL_S = 0.05
_SCHEDULES = {"sequential": sharded_prefill, "wavefront": wavefront_prefill}


@dataclass(frozen=True)
class ShardedPrefillOutcome:
    """What this rank's persisted sharded prefill did (the resume tests count work with it)."""

    ref: PrefixStateRef | None
    """The committed state (the same on every rank); None when persist_mode is "off"."""
    resumed_at: int
    """First global shard computed in this call (0: fresh; num_shards: all were recorded)."""
    shards_computed: int
    """Owned shards this rank computed (and wrote)."""
    shards_restored: int
    """Owned shards this rank read back from storage instead of computing them."""
    boundary_reads: int
    """Shards of the previous rank read back for lineage (0 or 1)."""


def _await_manifest(writer, shard: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while shard not in writer.completed_shards():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"shard {shard} (the previous rank's last) has no manifest after {timeout_s:.0f} s; "
                "its writer died or is stuck — rerun to resume from the recorded shards"
            )
        time.sleep(_POLL_S)


def _adopt_boundary_shard(writer, state: PrefixState, timeout_s: float) -> None:
    """Make the previous rank's last shard known to this rank's writer, and check lineage."""
    previous = state.shards[0] - 1
    _await_manifest(writer, previous, timeout_s)
    data = writer.read_shard(previous)
    for name, piece in data.checkpoints.items():
        handed = state.tensors()[name][:, 0]
        if not torch.equal(piece, handed.cpu()):
            raise StateKeyMismatchError(
                f"recorded shard {previous} ends in another {name!r} than the state rank "
                f"{state.rank - 1} handed to rank {state.rank}: the recorded shards do not come "
                "from this computation (other weights or a different attempt); gc the directory"
            )


def _broadcast_int(value: int, group) -> int:
    """Rank 0's `value` (of `group`) on every rank."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, group=group, group_src=0)
    return int(t.item())


class ShardedPrefillSession:
    """One prompt's persisted sharded prefill, a few shards at a time: the ranks' counterpart of
    the single-process `PrefillSession`, so that an orchestrator makes each shard a task on the
    ranks too. Every rank calls each method together (they are collectives)."""

    def __init__(
        self,
        model: PreTrainedModel,
        prompt_ids: torch.Tensor | Sequence[int],
        *,
        shard_tokens: int,
        storage: StorageConfig,
        key: StateKey,
        group: dist.ProcessGroup | None = None,
        on_shard: Callable[[PrefixState, int], None] | None = None,
        manifest_timeout_s: float = 300.0,
        schedule: Literal["sequential", "wavefront"] = "sequential",
        budget: StateBudget | None = None,
    ):
        """`budget` (None: resident): this rank's
        slice is tiered from the start, its shards' rows written straight to the lower tier."""
        if schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(_SCHEDULES)}, got {schedule!r}")
        self.model, self.group, self.schedule = model, group, schedule
        self.shard_tokens, self.on_shard = shard_tokens, on_shard
        self.manifest_timeout_s = manifest_timeout_s
        self.tiered = None
        if budget is None:
            self.state = allocate_sharded_state(
                model, prompt_ids, shard_tokens=shard_tokens, group=group
            )
        else:
            shapes = allocate_sharded_state(
                model, prompt_ids, shard_tokens=shard_tokens, group=group, device="meta"
            )
            self.tiered = tiered_like(model, shapes, budget)
            self.state = self.tiered.state
        self.storage = storage
        self.writer = None
        self.resume_at = 0
        self.restored: list[int] = []
        self.computed: list[int] = []
        self.needs_boundary = False
        self.outcome: ShardedPrefillOutcome | None = None
        if storage.persist_mode != "off":
            self.writer = open_persisting_writer(
                storage, key, state_layout(self.state), resume=True
            )
            self.key = key
            with self._closing_on_error():
                # Rank 0's view decides: ranks listing the directory at slightly different
                # moments must still agree on where the computation starts.
                first = self.writer.next_shard() if self.state.rank == 0 else 0
                self.resume_at = _broadcast_int(first, group)
                self.restored = [k for k in self.state.shards if k < self.resume_at]
                for k in self.restored:
                    restore_shard(self.state, k, self.writer.read_shard(k))
                # The first shard this rank writes follows a shard it did not write or read:
                # the previous rank's last one.
                shards = self.state.shards
                self.needs_boundary = shards[0] > 0 and self.resume_at <= shards[0]
        self.filled = self.resume_at
        """Global shards 0..filled-1 are in every rank's slice."""
        self.complete = False
        """Every shard is in, and every rank holds the final linear-attention state."""

    @contextlib.contextmanager
    def _closing_on_error(self):
        try:
            yield
        except BaseException:
            # The caller's error matters, not a follow-up one from the writer's thread.
            with contextlib.suppress(Exception):
                self.close()
            raise

    def _persist(self, local: PrefixState, shard: int) -> None:
        if self.writer is not None:
            if shard == local.shards[0] and self.needs_boundary:
                _adopt_boundary_shard(self.writer, local, self.manifest_timeout_s)
            self.writer.write_shard(shard, *shard_payload(local, shard))
        self.computed.append(shard)
        if self.on_shard is not None:
            self.on_shard(local, shard)

    @property
    def num_shards(self) -> int:
        return self.state.num_shards

    def ensure_shard(self, shard: int) -> None:
        """Make global shards 0..`shard` present on every rank (the wavefront schedule computes
        every shard at its first call)."""
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard {shard} is out of range [0, {self.num_shards})")
        if shard >= self.filled:
            self._run(self.num_shards if self.schedule == "wavefront" else shard + 1)

    def computed_through(self, shard: int) -> bool:
        """`ensure_shard(shard)` on every rank; whether any rank computed a shard in this call
        (its owner did, or nobody). Collective."""
        before = len(self.computed)
        self.ensure_shard(shard)
        flag = torch.tensor([int(len(self.computed) > before)])
        dist.all_reduce(flag, group=self.group)
        return bool(flag.item())

    def totals(self) -> tuple[PrefixStateRef | None, int, int]:
        """After `finish`: (the committed state, shards computed, shards restored), counted over
        every rank. Collective."""
        counts = torch.tensor([self.outcome.shards_computed, self.outcome.shards_restored])
        dist.all_reduce(counts, group=self.group)
        return self.outcome.ref, int(counts[0]), int(counts[1])

    def _run(self, end: int) -> None:
        """Compute global shards filled..end-1; at the end (even when every shard was restored)
        the linear-state handoffs are replayed and the final state reaches every rank."""
        bounds = {} if self.schedule == "wavefront" else {"end_shard": end}
        with self._closing_on_error():
            self.state = _SCHEDULES[self.schedule](
                self.model,
                self.state.prompt_ids,
                shard_tokens=self.shard_tokens,
                group=self.group,
                on_shard=self._persist,
                resume=self.state,
                start_shard=self.filled,
                **bounds,
            )
        self.filled = end
        self.complete = end == self.num_shards

    def finish(self) -> tuple[PrefixState, ShardedPrefillOutcome]:
        """Fill every shard, then commit the state once (rank 0) and close; again: the same."""
        if self.outcome is not None:
            return self.state, self.outcome
        if not self.complete:
            self._run(self.num_shards)
        ref = None
        if self.writer is not None:
            with self._closing_on_error():
                if isinstance(self.writer, BackgroundStateWriter):
                    self.writer.flush()
                # Every shard is recorded once every rank has flushed its own.
                dist.barrier(group=self.group)
                if self.state.rank == 0:
                    ref = self.writer.commit()
                dist.barrier(group=self.group)
                if self.state.rank != 0:
                    _, ref = read_manifest(state_dir_uri(self.storage, self.key), self.storage)
            self.close()
        self.outcome = ShardedPrefillOutcome(
            ref, self.resume_at, len(self.computed), len(self.restored), int(self.needs_boundary)
        )
        return self.state, self.outcome

    def close(self) -> None:
        """Close the storage writer (the state stays usable)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def discard(self) -> None:
        """Close the writer and drop the state (a tiered one's hooks and scratch files too)."""
        self.close()
        if self.tiered is not None:
            self.tiered.close()
            self.tiered = None


def persisted_sharded_prefill(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor | Sequence[int],
    *,
    shard_tokens: int,
    storage: StorageConfig,
    key: StateKey,
    group: dist.ProcessGroup | None = None,
    on_shard: Callable[[PrefixState, int], None] | None = None,
    manifest_timeout_s: float = 300.0,
    schedule: Literal["sequential", "wavefront"] = "sequential",
) -> tuple[PrefixState, ShardedPrefillOutcome]:
    """This rank's slice of the prompt state for `key`: resumed, computed and persisted.

    Call on every rank of `group` with the same arguments. `on_shard(state, s)` runs on the owner
    after shard s is computed AND handed to its writer (recorded, with persist_mode
    "synchronous"). The result is bitwise what an uninterrupted `sharded_prefill` gives.

    `schedule`: "sequential" (`sharded_prefill`) records each shard as soon as it is computed, so
    a crash loses at most the shard in progress; "wavefront" (`wavefront_prefill`: all ranks compute
    at once) records a rank's shards only once the whole wavefront is done, so a crash loses the
    call's work. Both resume from the recorded shards and give the same bits.
    """
    session = ShardedPrefillSession(
        model, prompt_ids, shard_tokens=shard_tokens, storage=storage, key=key, group=group,
        on_shard=on_shard, manifest_timeout_s=manifest_timeout_s, schedule=schedule,
    )  # fmt: skip
    try:
        return session.finish()
    finally:
        session.close()
