"""Each layer kind's cache layer on the ranks of a sequence group (`engine.layer_placement` is
one process's): the cross-rank attention and each attention kind's cross-rank layer.

Replicated (a branch, a segment, a decode step: every rank runs the same forward), each rank's
attention layers read their own positions and the cross-rank attention (`cross_rank_attention`,
`cross_rank_mla`) merges every rank's partial, so every rank gets the same bits. Owner mode (a
prefill or sweep shard): the rank that holds the shard computes it while the others serve their
prefix (`shard_ownership`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.cross_rank_attention import KvRanks
from longstraw.distributed.cross_rank_mla import (
    CrossRankMlaLayer,
    CrossRankSegmentMlaLayer,
    cross_rank_mla_installed,
)
from longstraw.engine import attention
from longstraw.engine.cache import StateCache
from longstraw.engine.layer_placement import LayerPlacement
from longstraw.engine.prefill import prefill_cache
from longstraw.engine.state import PrefixState
from longstraw.models.glm import is_glm


def owner_kind_kwargs(
    state,
    shard: int,
    group,
    *,
    mla_layer_class: type[CrossRankMlaLayer] = CrossRankMlaLayer,
    kv_ranks=KvRanks,
) -> dict:
    """Each kind's cache layer on the rank that holds `shard` and computes it (prefill) or
    recomputes it (sweep) while the other ranks serve their prefix (owner mode); `kv_ranks`
    builds a full-attention layer's `PrefixRanks` from (group, owner, slot)."""
    ranks = {"group": group, "owner": state.rank}
    return {
        "full_attention": lambda slot: {"ranks": kv_ranks(group, state.rank, slot)},
        "mla": {
            "layer_class": mla_layer_class,
            "num_prefix": state.bounds[shard][0],
            "local_start": state.token_start,
            **ranks,
        },
    }


def cross_rank_kind_kwargs(state, group, **layer_kwargs) -> dict:
    """Each kind's replicated cross-rank cache layer over `state` (this rank's slice), for
    `layer_kinds.branch_layers`; `layer_kwargs` adds arguments of the attention kinds' layers
    (`keep_branch` when decoding)."""
    ranks = {"group": group, "owner": None, **layer_kwargs}
    return {
        "full_attention": {"ranks": KvRanks(group), **layer_kwargs},
        "mla": {
            "layer_class": CrossRankMlaLayer,
            "num_prefix": state.num_tokens,
            "local_start": state.token_start,
            **ranks,
        },
    }


def owner_prefill_cache(
    state: PrefixState,
    shard: int,
    *,
    group,
    mla_layer_class: type[CrossRankMlaLayer] = CrossRankMlaLayer,
    kv_ranks=KvRanks,
) -> StateCache:
    """The layers that write `shard`'s K/V (GLM-5: latents, rope and indexer keys) and its
    end-of-shard linear checkpoints into this rank's `state`: what the owner runs the shard's
    forward on, whichever schedule (`engine.prefill` over `CrossRankExchange`,
    `wavefront_prefill`)."""
    kinds = owner_kind_kwargs(
        state, shard, group, mla_layer_class=mla_layer_class, kv_ranks=kv_ranks
    )
    return prefill_cache(state, shard, kinds)


def _cross_rank_layers_installed(model: PreTrainedModel) -> contextlib.AbstractContextManager:
    # GLM-5's attention modules are replaced whole (latent prefix, global DSA top-k).
    return cross_rank_mla_installed(model) if is_glm(model) else contextlib.nullcontext()


def cross_rank_attention_enabled(model: PreTrainedModel) -> contextlib.AbstractContextManager:
    """Run `model`'s full-attention (and GLM MLA) layers across ranks inside the block."""
    return attention.attention_selected(
        model, attention.ATTENTION_NAME, _cross_rank_layers_installed
    )


@dataclass(frozen=True)
class CrossRankLayers(LayerPlacement):
    """The prompt state is split over the ranks of `group` (None: the default group)."""

    group: dist.ProcessGroup | None = None

    def attention_enabled(self, model: PreTrainedModel) -> contextlib.AbstractContextManager:
        return cross_rank_attention_enabled(model)

    def branch_kwargs(self, state, *, keep_branch: bool, branch_capacity: int) -> dict:
        # The cross-rank layers grow their kept K/V step by step: no capacity to preallocate.
        del branch_capacity
        return cross_rank_kind_kwargs(state, self.group, keep_branch=keep_branch)

    def segment_kwargs(self, state) -> dict:
        kinds = cross_rank_kind_kwargs(state, self.group)
        return {
            "full_attention": kinds["full_attention"],
            "mla": kinds["mla"] | {"layer_class": CrossRankSegmentMlaLayer},
        }

    def owner_kwargs(self, state, shard: int) -> dict:
        return owner_kind_kwargs(state, shard, self.group)
