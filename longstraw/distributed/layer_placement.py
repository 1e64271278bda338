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

from longstraw.distributed.cross_rank_attention import (
    CrossRankAttentionLayer,
    cross_rank_attention_enabled,
)
from longstraw.distributed.cross_rank_mla import CrossRankMlaLayer, CrossRankSegmentMlaLayer
from longstraw.engine.cache import StateCache
from longstraw.engine.layer_placement import LayerPlacement
from longstraw.engine.prefill import prefill_cache
from longstraw.engine.state import PrefixState


def owner_kind_kwargs(
    state, shard: int, group, *, mla_layer_class: type[CrossRankMlaLayer] = CrossRankMlaLayer
) -> dict:
    """Each kind's cache layer on the rank that holds `shard` and computes it (prefill) or
    recomputes it (sweep) while the other ranks serve their prefix (owner mode)."""
    ranks = {"group": group, "owner": state.rank}
    return {
        "full_attention": lambda slot: {
            "layer_class": CrossRankAttentionLayer,
            "slot": slot,
            **ranks,
        },
        "mla": {
            "layer_class": mla_layer_class,
            "num_prefix": state.bounds[shard][0],
            "local_start": state.token_start,
            **ranks,
        },
    }


def cross_rank_kind_kwargs(state, group, **attention) -> dict:
    """Each kind's replicated cross-rank cache layer over `state` (this rank's slice), for
    `layer_kinds.branch_layers`; `attention` adds arguments of the attention kinds' layers
    (`keep_branch` when decoding)."""
    ranks = {"group": group, "owner": None, **attention}
    return {
        "full_attention": {"layer_class": CrossRankAttentionLayer, **ranks},
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
) -> StateCache:
    """The layers that write `shard`'s K/V (GLM-5: latents, rope and indexer keys) and its
    end-of-shard linear checkpoints into this rank's `state`: what the owner runs the shard's
    forward on, whichever schedule (`engine.prefill` over `CrossRankExchange`,
    `wavefront_prefill`)."""
    kinds = owner_kind_kwargs(state, shard, group, mla_layer_class=mla_layer_class)
    return prefill_cache(state, shard, kinds)


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
