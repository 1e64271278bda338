"""Prefill that persists its state shard by shard, and resumes or reuses what storage holds.

One session class for every placement: this process's part of the prompt state is the whole
state on one process (`engine.exchange.LOCAL`) or a rank's slice on a sequence group
(`longstraw.distributed.exchange.CrossRankExchange`), and the same code persists either.

* Reuse: a committed state for the same key (weights digest, version, prompt) is read back
  instead of recomputed (free in-process: the storage cache holds the very tensors; under a
  state budget it streams from its Zarr chunks). Only a whole state is reused whole; on ranks
  each one reads its own committed shards back.
* Resume: the shards before the first one without a manifest (manifests always form a prefix:
  storage records shard k only after k-1) are read back, not recomputed, and the finished state
  is bitwise what an uninterrupted prefill gives. The leader's view of the directory decides, so
  ranks that list it at slightly different moments agree where the computation starts.
* One writer per rank: every rank opens its own writer attempt on the same state directory and
  writes only the shards it owns (their K/V chunks and end-of-shard linear checkpoints; rank 0
  also shard 0's start checkpoint). Shard manifests are created exclusively by storage.
* Lineage across ranks: storage lets a writer record shard k only once it knows shard k-1 as
  recorded. For a rank's first shard k0 > 0, shard k0-1 belongs to the previous rank; the rank
  waits for that manifest, reads the shard back (hash-checked) and checks that its end
  linear-attention state is bitwise the state the previous rank handed over at the boundary
  (one shard read per ownership boundary).
* The commit is exclusive and happens once: after every rank has its shards recorded, the
  leader commits (COMMITTED.json is created exclusively) and the others read its manifest.

`PrefillSession` does this a few shards at a time, so an orchestrator makes each shard a task:
`ensure_shard(k)` fills shards 0..k. On ranks every method is collective (all ranks call it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedModel

from longstraw.engine.exchange import LOCAL, PrefixExchange
from longstraw.engine.prefill import allocate_prompt_state, prefill, prompt_tensor
from longstraw.engine.state import WHOLE, PrefixState
from longstraw.engine.state_layout import restore_shard, shard_payload, state_layout
from longstraw.engine.state_tiers import StateBudget, allocate_tiered_state
from longstraw.models.adapters import state_spec
from longstraw.schemas.storage import PrefixStateRef, StateKey, StorageConfig
from longstraw.storage import (
    BackgroundStateWriter,
    StateKeyMismatchError,
    StateNotCommittedError,
    open_committed_state,
    open_persisting_writer,
    read_manifest,
)
from longstraw.storage.paths import state_dir_uri

SCHEDULES = ("sequential", "wavefront")
"""How the ranks compute the shards: one shard at a time, each recorded as soon as it is done
(a crash loses at most the shard in progress), or all ranks at once on a layer wavefront
(`longstraw.distributed.wavefront_prefill`: a rank's shards are recorded once the whole
wavefront is done, so a crash loses the call's work). One process computes sequentially."""

# How often a rank looks for the previous rank's boundary shard manifest (background writers
# record it asynchronously; synchronous ones have it before the next shard starts).
_POLL_S = 0.05


@dataclass(frozen=True)
class PrefillOutcome:
    """What a persisted prefill did on this process (the resume tests count work with it)."""

    ref: PrefixStateRef | None
    """The committed state (the same on every rank); None when persist_mode is "off"."""
    shards_computed: int
    """Shards this process computed (and wrote)."""
    shards_reused: int
    """Shards this process read back from storage instead of computing them."""
    reused_committed: bool
    """The whole committed state was reused (one process only)."""
    resumed_at: int
    """First shard computed (0: fresh; num_shards: every shard was recorded)."""
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


class PrefillSession:
    """One prompt's prefill for one key on this process's part of the state, computed or
    recovered shard by shard.

    With `budget`, the state is tiered from the start (`engine.state_tiers`): each shard's rows
    go straight to the lower tier, a committed whole state streams from its Zarr chunks, and the
    process never holds its whole per-token state. `on_shard(state, k)` runs on the holder after
    shard k is computed and handed to its writer (recorded, with persist_mode "synchronous")."""

    def __init__(
        self,
        model: PreTrainedModel,
        prompt_ids: torch.Tensor | Sequence[int],
        *,
        shard_tokens: int,
        storage: StorageConfig,
        key: StateKey,
        budget: StateBudget | None = None,
        exchange: PrefixExchange = LOCAL,
        schedule: Literal["sequential", "wavefront"] = "sequential",
        on_shard: Callable[[PrefixState, int], None] | None = None,
        manifest_timeout_s: float = 300.0,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        self.model, self.exchange, self.schedule = model, exchange, schedule
        self.ids = prompt_tensor(model, prompt_ids).cpu()
        self.shard_tokens, self.storage, self.key, self.budget = shard_tokens, storage, key, budget
        self.on_shard, self.manifest_timeout_s = on_shard, manifest_timeout_s
        self.whole = exchange.shards.placement() == WHOLE
        self.tiered = None
        self.writer = None
        self.ref: PrefixStateRef | None = None
        self.reused_committed = False
        self.resume_at = 0
        self.reused: list[int] = []
        self.computed: list[int] = []
        self.needs_boundary = False
        self.outcome: PrefillOutcome | None = None
        persist = storage.persist_mode != "off" and self.ids.numel() >= 2
        if persist and self.whole and self._reuse_committed():
            return
        if budget is None:
            self.state = allocate_prompt_state(
                model, self.ids, shard_tokens=shard_tokens, exchange=exchange
            )
        else:
            self.tiered = allocate_tiered_state(
                model, self.ids, shard_tokens, budget, placement=exchange.shards.placement()
            )
            self.state = self.tiered.state
        if persist:
            self.writer = open_persisting_writer(
                storage, key, state_layout(self.state), resume=True
            )
            with self._closing_on_error():
                self.resume_at = exchange.collectives.on_leader(self.writer.next_shard)
                self.reused = [k for k in self.state.shards if k < self.resume_at]
                for k in self.reused:
                    restore_shard(self.state, k, self.writer.read_shard(k))
                # The first shard this rank writes follows a shard it did not write or read:
                # the previous rank's last one.
                shards = self.state.shards
                self.needs_boundary = shards[0] > 0 and self.resume_at <= shards[0]
        self.filled = self.resume_at
        """Shards 0..filled-1 are in this process's part of the state."""
        self.complete = False
        """Every shard is in, and every rank holds the final linear-attention state."""

    def _reuse_committed(self) -> bool:
        """The committed whole state of this key, read back (or, under a budget, streamed from its
        Zarr chunks), if there is one."""
        policy_version = self.key.policy_version if self.key.kind == "policy" else None
        where = state_dir_uri(self.storage, self.key)
        expect = dict(expect_weights_digest=self.key.weights_digest,
                      expect_policy_version=policy_version, config=self.storage)  # fmt: skip
        try:
            if self.budget is None:
                committed = open_committed_state(where, **expect)
            else:
                from longstraw.storage.streamed_state import open_streamed_state

                committed = open_streamed_state(where, **expect)
        except StateNotCommittedError:
            return False
        if self.budget is None:
            tensors = {name: t.to(self.model.device) for name, t in committed.tensors.items()}
            self.state = PrefixState.from_tensors(
                state_spec(self.model), prompt_ids=self.ids, shard_tokens=self.shard_tokens,
                tensors=tensors,
            )  # fmt: skip
        else:
            from longstraw.training.streamed_state import tier_committed_state

            budget = self.budget
            self.tiered = tier_committed_state(
                self.model, committed, self.ids, budget_bytes=budget.budget_bytes,
                lower=budget.lower, directory=budget.directory, exact=budget.exact,
            )  # fmt: skip
            self.state = self.tiered.state
        self.ref, self.reused_committed = committed.ref, True
        self.resume_at = self.filled = self.state.num_shards
        self.reused = list(range(self.state.num_shards))
        self.complete = True
        return True

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

    @property
    def shards_computed(self) -> int:
        """Shards this process computed so far."""
        return len(self.computed)

    @property
    def shards_reused(self) -> int:
        """Shards this process read back from storage so far."""
        return len(self.reused)

    def ensure_shard(self, shard: int) -> None:
        """Make shards 0..`shard` present (on ranks: in every rank's part; the wavefront
        schedule computes every shard at its first call)."""
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard {shard} is out of range [0, {self.num_shards})")
        if shard >= self.filled:
            self._run(self.num_shards if self._wavefront else shard + 1)

    @property
    def _wavefront(self) -> bool:
        return self.schedule == "wavefront" and not self.whole

    def computed_through(self, shard: int) -> bool:
        """`ensure_shard(shard)`; whether this call computed a shard (on ranks: any rank did)
        rather than reading every one back."""
        before = len(self.computed)
        self.ensure_shard(shard)
        (computed,) = self.exchange.collectives.busiest([int(len(self.computed) > before)])
        return bool(computed)

    def totals(self) -> tuple[PrefixStateRef | None, int, int]:
        """After `finish`: (the committed state, shards computed, shards reused), counted over
        every rank."""
        outcome = self.outcome
        computed, reused = self.exchange.collectives.summed(
            [outcome.shards_computed, outcome.shards_reused]
        )
        return outcome.ref, computed, reused

    def _run(self, end: int) -> None:
        """Compute shards filled..end-1; at the end (even when every shard was read back) the
        linear-state hand-overs are replayed and the final state reaches every rank."""
        options = dict(shard_tokens=self.shard_tokens, on_shard=self._persist, resume=self.state,
                       start_shard=self.filled)  # fmt: skip
        with self._closing_on_error():
            if self._wavefront:
                from longstraw.distributed.wavefront_prefill import wavefront_prefill

                self.state = wavefront_prefill(
                    self.model, self.ids, group=self.exchange.shards.group, **options
                )
            else:
                # One shard a call, as a task per shard makes them; with none to compute, one
                # call still replays the hand-overs and shares the final state.
                for start in range(self.filled, end) or [end]:
                    options["start_shard"] = start
                    self.state = prefill(
                        self.model, self.ids, end_shard=min(start + 1, end),
                        exchange=self.exchange, **options,
                    )  # fmt: skip
        self.filled = end
        self.complete = end == self.num_shards

    def finish(self) -> tuple[PrefixState, PrefillOutcome]:
        """Fill every shard, then commit the state once (the leader) and close; again: the
        same."""
        if self.outcome is not None:
            return self.state, self.outcome
        if not self.complete:
            self._run(self.num_shards)
        if self.writer is not None:
            with self._closing_on_error():
                self.ref = self._commit()
            self.close()
        self.outcome = PrefillOutcome(
            self.ref, self.shards_computed, self.shards_reused, self.reused_committed,
            self.resume_at, int(self.needs_boundary),
        )  # fmt: skip
        return self.state, self.outcome

    def _commit(self) -> PrefixStateRef:
        if isinstance(self.writer, BackgroundStateWriter):
            self.writer.flush()
        # Every shard is recorded once every rank has flushed its own.
        self.exchange.collectives.barrier()
        ref = None
        if self.exchange.collectives.is_leader:
            # A resident whole state seeds the in-process cache of committed states; a tiered
            # one, or a rank's slice, is read back from storage when asked for again.
            whole = self.whole and self.tiered is None
            ref = self.writer.commit(tensors=self.state.tensors() if whole else None)
        self.exchange.collectives.barrier()
        if ref is None:
            _, ref = read_manifest(state_dir_uri(self.storage, self.key), self.storage)
        return ref

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


def persisted_prefill(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor | Sequence[int],
    *,
    shard_tokens: int,
    storage: StorageConfig,
    key: StateKey,
    **options,
) -> tuple[PrefixState, PrefillOutcome]:
    """This process's part of the prompt state of `prompt_ids[:-1]` for `key`: reused, resumed
    or computed and persisted; bitwise what an uninterrupted `prefill` gives. `options` are
    `PrefillSession`'s (`exchange`, `schedule`, `on_shard`, `budget`, `manifest_timeout_s`); on
    ranks call on every rank with the same arguments."""
    session = PrefillSession(
        model, prompt_ids, shard_tokens=shard_tokens, storage=storage, key=key, **options
    )
    try:
        return session.finish()
    finally:
        session.close()
