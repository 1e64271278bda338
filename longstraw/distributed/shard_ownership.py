"""Which prefill shards each rank of a sequence group holds, and the protocol around the others
(`engine.shard_ownership` is one process's).

Each rank holds a contiguous range of the prompt's shards (`engine.state.Placement`). Prefill and
the reverse sweep walk the global shards in order (the sequential schedule, measured in
docs/scaling.md): the owner of shard s runs it — the ordinary transformers forward of its tokens
(`engine.prefill.run_shard_forward`), or its recomputation with autograd — while every other
rank serves the cross-rank attention (`serve_shard`): ranks before the owner contribute partials
over all their positions, ranks after it nothing yet (GLM-5's MLA layers the same way over their
latents, with a global DSA top-k: `cross_rank_mla`); in the sweep the servers add the shard's
contribution to their own positions' cotangent. At an ownership boundary the Gated DeltaNet conv
tail and recurrent state are broadcast from the previous owner (constant size), and in the sweep
their cotangent goes back; after the last shard the final linear-attention state is broadcast to
every rank, which replays branches from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.cross_rank_attention import finish_owner, serve_owner
from longstraw.distributed.cross_rank_mla import serve_mla_owner
from longstraw.distributed.topology import Topology
from longstraw.engine.layer_kinds import CHECKPOINT_ARRAYS
from longstraw.engine.shard_ownership import ShardOwnership
from longstraw.engine.state import Placement, PrefixState
from longstraw.models.adapters import attention_scales


def serving_prefixes(state: PrefixState, shard: int, cotangent=None):
    """(keys, values, grad_keys, grad_values) per full-attention layer that this rank serves."""
    if state.keys is None:
        return [], [], None, None
    end = state.local_prefix_end(shard)
    num = state.keys.shape[0]
    keys = [state.keys[i, :end] for i in range(num)]
    values = [state.values[i, :end] for i in range(num)]
    if cotangent is None:
        return keys, values, None, None
    return (
        keys,
        values,
        [cotangent.keys[i, :end] for i in range(num)],
        [cotangent.values[i, :end] for i in range(num)],
    )


def serve_shard(
    model: PreTrainedModel,
    state: PrefixState,
    shard: int,
    *,
    group,
    cotangent=None,
    on_gradient_slices: Callable[[int, int], None] | None = None,
) -> int:
    """Serve the owner of `shard` (not this rank) with this rank's prefix until it is done.

    `on_gradient_slices(owner, index)` answers the owner's `OP_GRADIENT_SLICES` headers (a sweep
    into sequence-sharded gradient accumulators, `longstraw.distributed.gradient_slices`)."""
    owner = state.owner_of(shard)
    if state.latent is None:
        keys, values, grad_keys, grad_values = serving_prefixes(state, shard, cotangent)
        fa = state.spec.full_attention
        by_layer = attention_scales(model)
        scales = [] if fa is None else [by_layer[i] for i in fa.layer_indices]
        return serve_owner(
            owner, keys, values, scales, group=group, grad_k_TKD=grad_keys,
            grad_v_TKD=grad_values, on_gradient_slices=on_gradient_slices,
        )  # fmt: skip
    # GLM-5: MLA layers only (no model family mixes MLA with K/V layers).
    assert state.keys is None, "a model with both MLA and K/V layers is not supported"
    end = state.local_prefix_end(shard)
    mla = state.spec.mla
    index = [
        state.indexer_key[mla.indexer_slot(i), :end] if i in mla.indexer_layer_indices else None
        for i in mla.layer_indices
    ]

    def rows(array) -> list | None:
        # Slot by slot: a tiered array hands out one slot's rows at a time.
        return None if array is None else [array[i, :end] for i in range(array.shape[0])]

    return serve_mla_owner(
        model, owner, rows(state.latent), rows(state.rope_key), index,
        local_start=state.token_start, group=group,
        grad_latent_TR=None if cotangent is None else rows(cotangent.latent),
        grad_rope_TE=None if cotangent is None else rows(cotangent.rope_key),
        on_gradient_slices=on_gradient_slices,
    )  # fmt: skip


@dataclass(frozen=True)
class CrossRankShards(ShardOwnership):
    """Rank `ranks.sequence_rank` of the sequence group `group` (None: the default group)."""

    ranks: Topology
    group: dist.ProcessGroup | None = None

    def placement(self) -> Placement:
        return Placement(self.ranks.sequence_rank, self.ranks.sequence_ranks)

    @property
    def recomputes_layers(self) -> bool:
        # A layer's recomputation in backward would read the prefix across the ranks again, out
        # of step with the servers: the shard keeps its layers' activations instead.
        return False

    def shard_name(self, state, shard: int) -> str:
        return f"shard {shard} on rank {state.rank}"

    def hand_over_start_state(self, state, shard: int) -> None:
        """One broadcast per linear array, from the previous owner: its last checkpoint is
        the new owner's first."""
        if state.conv is None:
            return
        previous, owner = state.owner_of(shard - 1), state.owner_of(shard)
        for array in CHECKPOINT_ARRAYS:
            full = getattr(state, array.field)
            if state.rank == previous:
                buffer = full[:, -1].contiguous()
            else:
                buffer = torch.empty_like(full[:, 0])
            dist.broadcast(buffer, group=self.group, group_src=previous)
            if state.rank == owner:
                full[:, 0] = buffer

    def share_final_state(self, state) -> None:
        """The last rank's final linear-attention state, broadcast to every rank."""
        if state.conv is None:
            return
        last = state.world_size - 1
        for array in CHECKPOINT_ARRAYS:
            final = getattr(state, f"final_{array.field}")
            if state.rank == last:
                final.copy_(getattr(state, array.field)[:, -1])
            dist.broadcast(final, group=self.group, group_src=last)

    def finish_owned_shard(self, state) -> None:
        finish_owner(state.rank, self.group)

    def serve_shard(self, model, state, shard: int, cotangent, on_gradient_slices) -> None:
        serve_shard(
            model, state, shard, group=self.group, cotangent=cotangent,
            on_gradient_slices=on_gradient_slices,
        )  # fmt: skip

    def hand_back_start_cotangent(self, state, cotangent, shard: int) -> None:
        if cotangent.conv is None:
            return
        owner, previous = state.owner_of(shard), state.owner_of(shard - 1)
        for array in CHECKPOINT_ARRAYS:
            buffer = getattr(cotangent, array.field)
            incoming = buffer if state.rank == owner else torch.empty_like(buffer)
            dist.broadcast(incoming, group=self.group, group_src=owner)
            if state.rank == previous:
                buffer.copy_(incoming)
