"""Prefill that persists its state shard by shard, and resumes or reuses what storage holds.

A committed state for the same key (weights digest, version, prompt) is read back instead of
recomputed (free in-process: the storage cache holds the very tensors). An interrupted prefill
resumes after its last shard manifest: the shards before it are read back, not recomputed, and
the finished state is bitwise what an uninterrupted prefill gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from longstraw.engine.prefill import prefill
from longstraw.engine.state import PrefixState
from longstraw.models.adapters import state_spec
from longstraw.schemas.storage import (
    ArraySpec,
    PrefixStateRef,
    StateKey,
    StateLayout,
    StorageConfig,
)
from longstraw.storage import StateNotCommittedError, open_committed_state, open_persisting_writer
from longstraw.storage.paths import state_dir_uri

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class PrefillOutcome:
    """What a persisted prefill did (the resume tests count work with it)."""

    ref: PrefixStateRef | None
    shards_computed: int
    shards_reused: int
    reused_committed: bool


def state_layout(state: PrefixState) -> StateLayout:
    """The storage layout of a prompt state's arrays."""
    specs = []
    for name, tensor in state.tensors().items():
        kind = "checkpoint" if name.startswith("linear_attention/") else "token"
        specs.append(
            ArraySpec(
                name=name, kind=kind, shape=tuple(tensor.shape), dtype=_DTYPE_NAMES[tensor.dtype]
            )
        )
    return StateLayout.build(specs, state.num_tokens, state.shard_tokens)


def persisted_prefill(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    *,
    shard_tokens: int,
    storage: StorageConfig,
    key: StateKey,
) -> tuple[PrefixState, PrefillOutcome]:
    """The prompt state of `prompt_ids[:-1]` for `key`: reused, resumed or computed and persisted."""
    ids = prompt_ids.to(torch.long).cpu()
    if storage.persist_mode == "off" or ids.numel() < 2:
        state = prefill(model, ids, shard_tokens=shard_tokens)
        return state, PrefillOutcome(None, state.num_shards, 0, False)

    spec = state_spec(model)
    policy_version = key.policy_version if key.kind == "policy" else None
    try:
        committed = open_committed_state(
            state_dir_uri(storage, key),
            expect_weights_digest=key.weights_digest,
            expect_policy_version=policy_version,
            config=storage,
        )
    except StateNotCommittedError:
        committed = None
    if committed is not None:
        tensors = {name: t.to(model.device) for name, t in committed.tensors.items()}
        state = PrefixState.from_tensors(
            spec, prompt_ids=ids, shard_tokens=shard_tokens, tensors=tensors
        )
        return state, PrefillOutcome(committed.ref, 0, state.num_shards, True)

    dtype = next(model.parameters()).dtype
    state = PrefixState.allocate(
        spec, prompt_ids=ids, shard_tokens=shard_tokens, dtype=dtype, device=model.device
    )
    layout = state_layout(state)
    writer = open_persisting_writer(storage, key, layout, resume=True)
    try:
        done = writer.completed_shards()
        reused = 0
        while reused in done:  # a contiguous run of finished shards from the start
            _fill_shard(state, reused, writer.read_shard(reused))
            reused += 1

        def persist(state: PrefixState, shard: int) -> None:
            writer.write_shard(shard, *_shard_payload(state, shard))

        state = prefill(
            model,
            ids,
            shard_tokens=shard_tokens,
            resume=state,
            start_shard=reused,
            on_shard=persist,
        )
        ref = writer.commit(tensors=state.tensors())
    finally:
        writer.close()
    return state, PrefillOutcome(ref, state.num_shards - reused, reused, False)


def _shard_payload(state: PrefixState, shard: int):
    start, end = state.bounds[shard]
    tokens, ends, initial = {}, {}, {}
    for name, tensor in state.tensors().items():
        if name.startswith("linear_attention/"):
            ends[name] = tensor[:, shard + 1]
            initial[name] = tensor[:, 0]
        else:
            tokens[name] = tensor[:, start:end]
    return tokens, ends, (initial if shard == 0 else None)


def _fill_shard(state: PrefixState, shard: int, data) -> None:
    start, end = state.bounds[shard]
    tensors = state.tensors()
    for name, piece in data.token_slices.items():
        tensors[name][:, start:end] = piece.to(tensors[name].device)
    for name, piece in data.checkpoints.items():
        tensors[name][:, shard + 1] = piece.to(tensors[name].device)
    for name, piece in (data.initial_checkpoints or {}).items():
        tensors[name][:, 0] = piece.to(tensors[name].device)
