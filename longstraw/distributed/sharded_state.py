"""The prompt state split by sequence position across ranks: which rank holds what.

Legend: L layers of one kind, T_r state tokens on rank r, K kv heads, D head dim, n_r prefill
shards on rank r, C conv channels, W conv tail, H value heads, Dk/Dv key/value head dims.

Rank r owns a contiguous range of prefill shards (the first `num_shards % world` ranks one more)
and so a contiguous range of positions [token_start, token_end): their full-attention K/V (or,
for GLM-5, their MLA latents, rope keys and DSA indexer keys), and the Gated DeltaNet checkpoints at the start of each of its shards plus the end of its last one.
Every rank also keeps the FINAL linear-attention state (constant size): branches replay on every
rank and start from it. Placement only: these are the single-process state's tensors, sliced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from longstraw.engine.layer_kinds import (
    CHECKPOINT_ARRAYS,
    STATE_ARRAYS,
    TOKEN_ARRAYS,
    allocate_state_arrays,
    nbytes,
)
from longstraw.engine.state import PrefixState, shard_bounds
from longstraw.models.adapters import StateSpec


def rank_shard_ranges(num_shards: int, world_size: int) -> tuple[range, ...]:
    """The prefill shards each rank owns: contiguous, balanced, in rank order."""
    if num_shards < world_size:
        raise ValueError(
            f"{num_shards} prefill shards cannot be split over {world_size} ranks; use a smaller "
            "shard_tokens or fewer ranks (every rank must own at least one shard)"
        )
    base, extra = divmod(num_shards, world_size)
    ranges, start = [], 0
    for rank in range(world_size):
        count = base + (1 if rank < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return tuple(ranges)


@dataclass
class ShardedPrefixState:
    """This rank's slice of a prompt state (see the module docstring)."""

    spec: StateSpec
    prompt_ids: torch.Tensor
    """[P] int64, on every rank (8 bytes/token: the sweep recomputes shards from it)."""
    shard_tokens: int
    bounds: tuple[tuple[int, int], ...]
    """Global [start, end) of every prefill shard."""
    rank: int
    world_size: int
    shards: range
    """Global indices of the shards this rank owns."""
    keys: torch.Tensor | None
    """[L, T_r, K, D] keys of positions [token_start, token_end), model dtype."""
    values: torch.Tensor | None
    """[L, T_r, K, Dv]."""
    conv: torch.Tensor | None
    """[L, n_r + 1, C, W]: index i = start of shard shards[i]; index n_r = end of the last one."""
    recurrent: torch.Tensor | None
    """[L, n_r + 1, H, Dk, Dv] fp32, indexed like `conv`."""
    final_conv: torch.Tensor | None
    """[L, C, W] the linear-attention state after the whole prompt (branches start from it)."""
    final_recurrent: torch.Tensor | None
    """[L, H, Dk, Dv] fp32."""
    latent: torch.Tensor | None = None
    """[L, T_r, R] MLA latents of positions [token_start, token_end) (GLM-5), model dtype."""
    rope_key: torch.Tensor | None = None
    """[L, T_r, E] MLA shared rope keys."""
    indexer_key: torch.Tensor | None = None
    """[L_idx, T_r, Di] DSA indexer keys of the layers with their own indexer."""
    tiers: object | None = None
    """The `TieredState` whose lower tier holds this slice's per-token arrays
    (`engine.state_budget_bytes`: each rank streams its own slice), or None: resident."""

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.numel()

    @property
    def num_tokens(self) -> int:
        return self.prompt_len - 1

    @property
    def last_token_id(self) -> int:
        return int(self.prompt_ids[-1])

    @property
    def num_shards(self) -> int:
        return len(self.bounds)

    @property
    def token_start(self) -> int:
        return self.bounds[self.shards[0]][0]

    @property
    def token_end(self) -> int:
        return self.bounds[self.shards[-1]][1]

    def owner_of(self, shard: int) -> int:
        ranges = rank_shard_ranges(self.num_shards, self.world_size)
        return next(r for r, owned in enumerate(ranges) if shard in owned)

    def state_bytes(self) -> int:
        """Bytes of this rank's per-token part (K/V, MLA latents)."""
        return nbytes(getattr(self, a.field) for a in TOKEN_ARRAYS)

    def checkpoint_bytes(self) -> int:
        checkpoints = [getattr(self, a.field) for a in CHECKPOINT_ARRAYS]
        return nbytes([*checkpoints, self.final_conv, self.final_recurrent])

    @classmethod
    def allocate(
        cls,
        spec: StateSpec,
        *,
        prompt_ids: torch.Tensor,
        shard_tokens: int,
        rank: int,
        world_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> ShardedPrefixState:
        bounds = shard_bounds(prompt_ids.numel() - 1, shard_tokens)
        shards = rank_shard_ranges(len(bounds), world_size)[rank]
        num_local = bounds[shards[-1]][1] - bounds[shards[0]][0]
        arrays = allocate_state_arrays(
            spec, num_tokens=num_local, num_checkpoints=len(shards) + 1, dtype=dtype, device=device
        )
        conv, recurrent = arrays["conv"], arrays["recurrent"]
        final_conv = None if conv is None else torch.zeros_like(conv[:, 0])
        final_recurrent = None if recurrent is None else torch.zeros_like(recurrent[:, 0])
        return cls(
            spec, prompt_ids.cpu(), shard_tokens, bounds, rank, world_size, shards,
            final_conv=final_conv, final_recurrent=final_recurrent, **arrays,
        )  # fmt: skip

    def final_linear_state_all(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([L, C, W], [L, H, Dk, Dv]) every Gated DeltaNet layer's state after the prompt."""
        return self.final_conv, self.final_recurrent

    def final_linear_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([C, W], [H, Dk, Dv]) Gated DeltaNet layer `slot`'s state after the whole prompt."""
        return self.final_conv[slot], self.final_recurrent[slot]


def scatter_state(state: PrefixState, rank: int, world_size: int) -> ShardedPrefixState:
    """This rank's slice of a single-process state (copies; placement only, bitwise)."""
    shards = rank_shard_ranges(state.num_shards, world_size)[rank]
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
    return ShardedPrefixState(
        state.spec, state.prompt_ids, state.shard_tokens, state.bounds, rank, world_size, shards,
        final_conv=part(state.conv, (slice(None), final)),
        final_recurrent=part(state.recurrent, (slice(None), final)),
        **arrays,
    )  # fmt: skip


def gather_state(local: ShardedPrefixState, group: dist.ProcessGroup | None = None) -> PrefixState:
    """The whole single-process `PrefixState`, assembled on every rank (tests, persistence)."""
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
