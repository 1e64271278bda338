"""Each layer kind's cache layer on the ranks of a sequence group (`engine.layer_placement` is
one process's): the same layers and the same attention, each attention layer given the ranks
that hold the rest of its prefix (`KvRanks`, `LatentRanks`).

Replicated (a branch, a segment, a decode step: every rank runs the same forward), each rank's
attention layers read their own positions and the attention op merges every rank's partial
(`cross_rank_attention`, `cross_rank_mla`), so every rank gets the same bits. Owner mode (a
prefill or sweep shard): the rank that holds the shard computes it while the others serve their
prefix (`shard_ownership`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from longstraw.distributed.cross_rank_attention import KvRanks
from longstraw.distributed.cross_rank_mla import LatentRanks
from longstraw.engine.cache import StateCache
from longstraw.engine.layer_placement import LayerPlacement
from longstraw.engine.prefill import prefill_cache
from longstraw.engine.state import PrefixState


def _latent_ranks_of_slot(latent_ranks, state, group, owner: int | None, num_prefix: int):
    """MLA slot -> that layer's `LatentRanks` (`latent_ranks` builds it)."""

    def of_slot(slot: int):
        layer = state.spec.mla.layer_indices[slot]
        return latent_ranks(
            group, owner, layer, num_prefix=num_prefix, local_start=state.token_start
        )

    return of_slot


def owner_kind_kwargs(
    state, shard: int, group, *, kv_ranks=KvRanks, latent_ranks=LatentRanks
) -> dict:
    """Each attention kind's cache layer on the rank that holds `shard` and computes it
    (prefill) or recomputes it (sweep) while the other ranks serve their prefix (owner mode):
    the layer's ranks, built by `kv_ranks(group, owner, slot)` / `latent_ranks(group, owner,
    layer, num_prefix=, local_start=)` (the wavefront's own exchange: `wavefront_prefill`)."""
    owner = state.rank
    mla_ranks = _latent_ranks_of_slot(latent_ranks, state, group, owner, state.bounds[shard][0])
    return {
        "full_attention": lambda slot: {"ranks": kv_ranks(group, owner, slot)},
        "mla": lambda slot: {"ranks": mla_ranks(slot)},
    }


def cross_rank_kind_kwargs(state, group, **layer_kwargs) -> dict:
    """Each attention kind's replicated cross-rank cache layer over `state` (this rank's
    slice), for `layer_kinds.branch_layers` and `segment_layers`; `layer_kwargs` adds arguments
    of the attention kinds' layers (`keep_branch` when decoding)."""
    mla_ranks = _latent_ranks_of_slot(LatentRanks, state, group, None, state.num_tokens)
    return {
        "full_attention": {"ranks": KvRanks(group), **layer_kwargs},
        "mla": lambda slot: {"ranks": mla_ranks(slot), **layer_kwargs},
    }


def owner_prefill_cache(
    state: PrefixState, shard: int, *, group, kv_ranks=KvRanks, latent_ranks=LatentRanks
) -> StateCache:
    """The layers that write `shard`'s K/V (GLM-5: latents, rope and indexer keys) and its
    end-of-shard linear checkpoints into this rank's `state`: what the owner runs the shard's
    forward on, whichever schedule (`engine.prefill` over `CrossRankExchange`,
    `wavefront_prefill`)."""
    kinds = owner_kind_kwargs(state, shard, group, kv_ranks=kv_ranks, latent_ranks=latent_ranks)
    return prefill_cache(state, shard, kinds)


@dataclass(frozen=True)
class CrossRankLayers(LayerPlacement):
    """The prompt state is split over the ranks of `group` (None: the default group)."""

    group: dist.ProcessGroup | None = None

    def branch_kwargs(self, state, *, keep_branch: bool, branch_capacity: int) -> dict:
        # The cross-rank layers grow their kept K/V step by step: no capacity to preallocate.
        del branch_capacity
        return cross_rank_kind_kwargs(state, self.group, keep_branch=keep_branch)

    def segment_kwargs(self, state) -> dict:
        return cross_rank_kind_kwargs(state, self.group)

    def owner_kwargs(self, state, shard: int) -> dict:
        return owner_kind_kwargs(state, shard, self.group)
