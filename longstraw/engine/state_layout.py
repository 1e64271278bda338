"""A prompt state's storage layout and its shards' payloads, at any placement.

Storage holds the WHOLE state whichever process computed it (docs/design.md, "Storage"):
per-token arrays [L, T, ...] and shard-boundary checkpoint arrays [L, S + 1, ...], named and
kinded by each layer kind's declaration (`layer_kinds.STATE_ARRAYS`). A process writes and reads
back only the shards it holds: one process every shard, a rank of a sequence group its range.
So a state persisted by one process is read by ranks and the other way round.
"""

from __future__ import annotations

import torch

from longstraw.engine.layer_kinds import STATE_ARRAYS
from longstraw.engine.state import PrefixState, token_rows
from longstraw.schemas.storage import ArraySpec, StateLayout

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _held_arrays(state: PrefixState):
    """(declaration, this process's tensor) of every array the state holds."""
    for array in STATE_ARRAYS:
        tensor = getattr(state, array.field, None)
        if tensor is not None:
            yield array, tensor


def state_layout(state: PrefixState) -> StateLayout:
    """The storage layout of the whole state `state` is (a part of): the same on every rank."""
    specs = []
    for array, tensor in _held_arrays(state):
        along = state.num_tokens if array.per_token else state.num_shards + 1
        specs.append(
            ArraySpec(
                name=array.storage_name,
                kind="token" if array.per_token else "checkpoint",
                shape=(tensor.shape[0], along, *tensor.shape[2:]),
                dtype=DTYPE_NAMES[tensor.dtype],
            )
        )
    return StateLayout.build(specs, state.num_tokens, state.shard_tokens)


def shard_payload(state: PrefixState, shard: int):
    """(token slices, end checkpoints, start checkpoints for shard 0 else None) by storage name
    of a shard this process holds: what a state writer's `write_shard` takes."""
    rows = state.local_rows(*state.bounds[shard])
    local = state.local_checkpoint(shard)
    tokens, ends, initial = {}, {}, {}
    for array, tensor in _held_arrays(state):
        if array.per_token:
            tokens[array.storage_name] = token_rows(tensor, rows.start, rows.stop)
        else:
            ends[array.storage_name] = tensor[:, local + 1]
            initial[array.storage_name] = tensor[:, 0]
    return tokens, ends, (initial if shard == 0 else None)


def restore_shard(state: PrefixState, shard: int, data) -> None:
    """Put a shard read back from storage (`ShardData`: token slices, end checkpoints, shard 0's
    start checkpoints) into the state's rows for it; `shard` must be one this process holds."""
    rows = state.local_rows(*state.bounds[shard])
    local = state.local_checkpoint(shard)
    tensors = state.tensors()
    for name, piece in data.token_slices.items():
        target = tensors[name]
        for slot in range(target.shape[0]):
            target[slot, rows] = piece[slot].to(target.device)
    for name, piece in data.checkpoints.items():
        tensors[name][:, local + 1] = piece.to(tensors[name].device)
    for name, piece in (data.initial_checkpoints or {}).items():
        tensors[name][:, 0] = piece.to(tensors[name].device)
