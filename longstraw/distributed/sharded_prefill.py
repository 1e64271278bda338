"""Sequence-sharded prefill: each rank computes and keeps the prefill shards it owns.

The loop is `engine.prefill.prefill`'s over the ranks' `CrossRankExchange`; here are the
serving side and the owner's cache layers. Schedule (the naive one, measured in
docs/scaling.md): global shards in order; the owner of
shard s runs the ordinary transformers forward of its tokens (`run_shard_forward`) while every
other rank serves the cross-rank attention (`serve_owner`): ranks before the owner contribute
partials over all their positions, ranks after it contribute nothing yet (GLM-5's MLA layers
the same way over their latents, with a global DSA top-k: `cross_rank_mla`). At an ownership
boundary the Gated DeltaNet conv tail and recurrent state are broadcast from the previous owner
(constant size). At the end the final linear-attention state is broadcast to every rank, which
replays branches from it.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedModel

from longstraw.distributed.cross_rank_attention import (
    serve_owner,
)
from longstraw.distributed.cross_rank_mla import CrossRankMlaLayer, serve_mla_owner
from longstraw.distributed.exchange import owner_kind_kwargs
from longstraw.engine.cache import StateCache
from longstraw.engine.prefill import prefill_cache
from longstraw.engine.state import PrefixState


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
        return serve_owner(
            owner, keys, values, group=group, grad_k_TKD=grad_keys, grad_v_TKD=grad_values,
            on_gradient_slices=on_gradient_slices,
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


def owner_prefill_cache(
    state: PrefixState,
    shard: int,
    *,
    group,
    mla_layer_class: type[CrossRankMlaLayer] = CrossRankMlaLayer,
) -> StateCache:
    """The layers that write `shard`'s K/V (GLM-5: latents, rope and indexer keys) and its
    end-of-shard linear checkpoints into this rank's `state`: what the owner runs the shard's
    forward on, whichever schedule (`engine.prefill` over `CrossRankExchange`, `wavefront_prefill`)."""
    kinds = owner_kind_kwargs(state, shard, group, mla_layer_class=mla_layer_class)
    return prefill_cache(state, shard, kinds)
