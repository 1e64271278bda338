"""Moving a prompt state between placements: one process's whole state to a rank's part of it
and back (`engine.state.PrefixState` carries the placement; these copy bits, nothing else)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from longstraw.engine.layer_kinds import STATE_ARRAYS
from longstraw.engine.state import Placement, PrefixState, rank_shard_ranges


def scatter_state(state: PrefixState, rank: int, world_size: int) -> PrefixState:
    """Rank `rank`'s part of a whole state (copies; placement only, bitwise)."""
    placement = Placement(rank, world_size)
    shards = placement.shards(state.num_shards)
    start, end = state.bounds[shards[0]][0], state.bounds[shards[-1]][1]
    final = state.num_shards

    def part(t: torch.Tensor | None, index) -> torch.Tensor | None:
        return None if t is None else t[index].clone()

    rows = (slice(None), slice(start, end))
    checkpoints = (slice(None), slice(shards[0], shards[-1] + 2))
    arrays = {
        a.field: part(getattr(state, a.field), rows if a.per_token else checkpoints)
        for a in STATE_ARRAYS
    }
    return PrefixState(
        state.spec, state.prompt_ids, state.shard_tokens, state.bounds, placement=placement,
        final_conv=part(state.conv, (slice(None), final)),
        final_recurrent=part(state.recurrent, (slice(None), final)),
        **arrays,
    )  # fmt: skip


def gather_state(local: PrefixState, group: dist.ProcessGroup | None = None) -> PrefixState:
    """The whole state (world size 1), assembled on every rank from their parts (tests,
    persistence)."""
    state = PrefixState.allocate(
        local.spec,
        prompt_ids=local.prompt_ids,
        shard_tokens=local.shard_tokens,
        dtype=next(t for t in (local.keys, local.latent, local.conv) if t is not None).dtype,
    )
    ranges = rank_shard_ranges(local.num_shards, local.world_size)
    for array in STATE_ARRAYS:
        name = array.field
        mine = getattr(local, name)
        if mine is None:
            continue
        # all_gather needs equal sizes: pad every slice to the largest along the sliced dim.
        sizes = [
            (local.bounds[r[-1]][1] - local.bounds[r[0]][0]) if array.per_token else len(r) + 1
            for r in ranges
        ]
        padded = mine.new_zeros((mine.shape[0], max(sizes), *mine.shape[2:]))
        padded[:, : mine.shape[1]] = mine
        parts = [torch.empty_like(padded) for _ in ranges]
        dist.all_gather(parts, padded, group=group)
        whole = getattr(state, name)
        for owned, size, part in zip(ranges, sizes, parts, strict=True):
            if array.per_token:
                start = local.bounds[owned[0]][0]
                whole[:, start : start + size] = part[:, :size]
            else:
                # Rank r's last entry (end of its last shard) is rank r+1's first: same bits.
                whole[:, owned[0] : owned[-1] + 2] = part[:, :size]
    return state
