"""Prefill that persists its state shard by shard, and resumes or reuses what storage holds.

A committed state for the same key (weights digest, version, prompt) is read back instead of
recomputed (free in-process: the storage cache holds the very tensors). An interrupted prefill
resumes after its last shard manifest: the shards before it are read back, not recomputed, and
the finished state is bitwise what an uninterrupted prefill gives.

`PrefillSession` does this one shard at a time, so an orchestrator can make each shard a task:
`ensure_shard(k)` fills shards 0..k, reading from storage what a previous (crashed) run already
committed and computing the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from longstraw.engine.prefill import prefill
from longstraw.engine.state import PrefixState
from longstraw.engine.state_layout import restore_shard, shard_payload, state_layout
from longstraw.engine.state_tiers import StateBudget, allocate_tiered_state
from longstraw.models.adapters import state_spec
from longstraw.schemas.storage import PrefixStateRef, StateKey, StorageConfig
from longstraw.storage import StateNotCommittedError, open_committed_state, open_persisting_writer
from longstraw.storage.paths import state_dir_uri


@dataclass(frozen=True)
class PrefillOutcome:
    """What a persisted prefill did (the resume tests count work with it)."""

    ref: PrefixStateRef | None
    shards_computed: int
    shards_reused: int
    reused_committed: bool


class PrefillSession:
    """One prompt's prefill for one key, computed or recovered shard by shard.

    With `budget`, the state is tiered from the start (`engine.state_tiers`): each shard's rows
    go straight to the lower tier, a committed state streams from its Zarr chunks, and the
    process never holds the whole per-token state."""

    def __init__(
        self,
        model: PreTrainedModel,
        prompt_ids: torch.Tensor,
        *,
        shard_tokens: int,
        storage: StorageConfig,
        key: StateKey,
        budget: StateBudget | None = None,
    ):
        self.model = model
        self.budget = budget
        self.tiered = None
        self.ids = prompt_ids.to(torch.long).cpu()
        self.shard_tokens = shard_tokens
        self.storage = storage
        self.key = key
        self.shards_computed = 0
        self.shards_reused = 0
        self.ref: PrefixStateRef | None = None
        self.reused_committed = False
        self.writer = None
        spec = state_spec(model)
        persist = storage.persist_mode != "off" and self.ids.numel() >= 2
        if persist and budget is not None and self._stream_committed():
            return
        committed = self._committed() if persist and budget is None else None
        if committed is not None:
            tensors = {name: t.to(model.device) for name, t in committed.tensors.items()}
            self.state = PrefixState.from_tensors(
                spec, prompt_ids=self.ids, shard_tokens=shard_tokens, tensors=tensors
            )
            self.ref, self.reused_committed = committed.ref, True
            self.shards_reused = self.state.num_shards
            self.filled = self.state.num_shards
            return
        if budget is None:
            dtype = next(model.parameters()).dtype
            self.state = PrefixState.allocate(
                spec,
                prompt_ids=self.ids,
                shard_tokens=shard_tokens,
                dtype=dtype,
                device=model.device,
            )
        else:
            self.tiered = allocate_tiered_state(model, self.ids, shard_tokens, budget)
            self.state = self.tiered.state
        self.filled = 0
        """Shards 0..filled-1 are in `state`."""
        if persist:
            self.writer = open_persisting_writer(
                storage, key, state_layout(self.state), resume=True
            )

    def _stream_committed(self) -> bool:
        """With a budget: stream a committed state from its Zarr chunks (True), if there is one."""
        from longstraw.storage.streamed_state import open_streamed_state
        from longstraw.training.streamed_state import tier_committed_state

        policy_version = self.key.policy_version if self.key.kind == "policy" else None
        try:
            streamed = open_streamed_state(
                state_dir_uri(self.storage, self.key),
                expect_weights_digest=self.key.weights_digest,
                expect_policy_version=policy_version,
                config=self.storage,
            )
        except StateNotCommittedError:
            return False
        budget = self.budget
        self.tiered = tier_committed_state(
            self.model, streamed, self.ids, budget_bytes=budget.budget_bytes,
            lower=budget.lower, directory=budget.directory, exact=budget.exact,
        )  # fmt: skip
        self.state = self.tiered.state
        self.ref, self.reused_committed = streamed.ref, True
        self.shards_reused = self.filled = self.state.num_shards
        return True

    def _committed(self):
        policy_version = self.key.policy_version if self.key.kind == "policy" else None
        try:
            return open_committed_state(
                state_dir_uri(self.storage, self.key),
                expect_weights_digest=self.key.weights_digest,
                expect_policy_version=policy_version,
                config=self.storage,
            )
        except StateNotCommittedError:
            return None

    @property
    def num_shards(self) -> int:
        return self.state.num_shards

    def ensure_shard(self, shard: int) -> None:
        """Make shards 0..`shard` present: read back what storage has, compute the rest."""
        stored = set(self.writer.completed_shards()) if self.writer is not None else set()
        while self.filled <= shard:
            k = self.filled
            if k in stored:
                restore_shard(self.state, k, self.writer.read_shard(k))
                self.shards_reused += 1
            else:
                prefill(
                    self.model,
                    self.ids,
                    shard_tokens=self.shard_tokens,
                    resume=self.state,
                    start_shard=k,
                    end_shard=k + 1,
                )
                if self.writer is not None:
                    self.writer.write_shard(k, *shard_payload(self.state, k))
                self.shards_computed += 1
            self.filled += 1

    def computed_through(self, shard: int) -> bool:
        """`ensure_shard(shard)`; whether this call computed a shard (rather than reading every
        one back)."""
        before = self.shards_computed
        self.ensure_shard(shard)
        return self.shards_computed > before

    def totals(self) -> tuple[PrefixStateRef | None, int, int]:
        """After `finish`: (the committed state, shards computed, shards reused)."""
        return self.ref, self.shards_computed, self.shards_reused

    def finish(self) -> tuple[PrefixState, PrefillOutcome]:
        """Fill every shard, commit (when persisting) and close."""
        if self.num_shards:
            self.ensure_shard(self.num_shards - 1)
        if self.writer is not None:
            # A resident state seeds the in-process cache of committed states; a tiered one is
            # read back from storage when asked for again.
            tensors = None if self.tiered is not None else self.state.tensors()
            try:
                self.ref = self.writer.commit(tensors=tensors)
            finally:
                self.close()
        return self.state, PrefillOutcome(
            self.ref, self.shards_computed, self.shards_reused, self.reused_committed
        )

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
    prompt_ids: torch.Tensor,
    *,
    shard_tokens: int,
    storage: StorageConfig,
    key: StateKey,
) -> tuple[PrefixState, PrefillOutcome]:
    """The prompt state of `prompt_ids[:-1]` for `key`: reused, resumed or computed and persisted."""
    session = PrefillSession(model, prompt_ids, shard_tokens=shard_tokens, storage=storage, key=key)
    try:
        return session.finish()
    finally:
        session.close()
