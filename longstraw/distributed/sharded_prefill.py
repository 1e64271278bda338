"""Sequence-sharded prefill: each rank computes and keeps the prefill shards it owns.

Schedule (the naive one, measured in docs/scaling.md): global shards in order; the owner of
shard s runs the ordinary transformers forward of its tokens (`run_shard_forward`) while every
other rank serves the cross-rank attention (`serve_owner`): ranks before the owner contribute
partials over all their positions, ranks after it contribute nothing yet (GLM-5's MLA layers
the same way over their latents, with a global DSA top-k: `cross_rank_mla`). At an ownership
boundary the Gated DeltaNet conv tail and recurrent state are broadcast from the previous owner
(constant size). At the end the final linear-attention state is broadcast to every rank, which
replays branches from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.cross_rank_attention import (
    cross_rank_attention_enabled,
    finish_owner,
    serve_owner,
)
from longstraw.distributed.cross_rank_mla import CrossRankMlaLayer, serve_mla_owner
from longstraw.distributed.exchange import owner_kind_kwargs
from longstraw.engine.cache import StateCache
from longstraw.engine.layer_kinds import CHECKPOINT_ARRAYS, prefill_layers
from longstraw.engine.prefill import run_shard_forward
from longstraw.engine.state import Placement, PrefixState
from longstraw.engine.validation import as_token_tensor, check_positions
from longstraw.models.adapters import state_spec


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
    forward on, whichever schedule (`sharded_prefill`, `wavefront_prefill`)."""
    start, end = state.bounds[shard]
    layers = prefill_layers(
        state,
        prefix_end=state.local_prefix_end(shard),
        rows=state.local_rows(start, end),
        checkpoint=state.local_checkpoint(shard),
        kind_kwargs=owner_kind_kwargs(state, shard, group, mla_layer_class=mla_layer_class),
    )
    return StateCache(layers, position_offset=start)


def _handoff_linear_state(state: PrefixState, shard: int, group) -> None:
    """Broadcast the linear-attention state at the start of `shard` from the previous owner."""
    if state.conv is None or shard == 0:
        return
    previous, owner = state.owner_of(shard - 1), state.owner_of(shard)
    if previous == owner:
        return
    for array in CHECKPOINT_ARRAYS:
        full = getattr(state, array.field)
        if state.rank == previous:
            buffer = full[:, -1].contiguous()
        else:
            buffer = torch.empty_like(full[:, 0])
        dist.broadcast(buffer, group=group, group_src=previous)
        if state.rank == owner:
            full[:, 0] = buffer


def broadcast_final_linear_state(state: PrefixState, group) -> None:
    if state.conv is None:
        return
    last = state.world_size - 1
    for array in CHECKPOINT_ARRAYS:
        final = getattr(state, f"final_{array.field}")
        if state.rank == last:
            final.copy_(getattr(state, array.field)[:, -1])
        dist.broadcast(final, group=group, group_src=last)


def _prompt_tensor(model: PreTrainedModel, prompt_ids) -> torch.Tensor:
    ids = as_token_tensor(
        prompt_ids, what="prompt_ids", vocab_size=model.config.get_text_config().vocab_size
    )
    check_positions(state_spec(model), ids.numel(), what="the prompt")
    return ids


def allocate_sharded_state(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor | Sequence[int],
    *,
    shard_tokens: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> PrefixState:
    """This rank's empty slice of the prompt state (what `sharded_prefill` fills), on `device`
    (None: the model's; "meta": shapes only, for a tiered slice)."""
    return PrefixState.allocate(
        state_spec(model),
        prompt_ids=_prompt_tensor(model, prompt_ids),
        shard_tokens=shard_tokens,
        placement=Placement(dist.get_rank(group), dist.get_world_size(group)),
        dtype=next(model.parameters()).dtype,
        device=model.device if device is None else device,
    )


def prefill_target(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor | Sequence[int],
    *,
    shard_tokens: int,
    group: dist.ProcessGroup | None,
    resume: PrefixState | None,
    start_shard: int,
) -> PrefixState:
    """The state a sharded prefill fills: fresh, or `resume` checked against the arguments."""
    ids = _prompt_tensor(model, prompt_ids)
    if resume is None:
        if start_shard != 0:
            raise ValueError("start_shard > 0 needs the partially filled state as `resume=`")
        return allocate_sharded_state(model, ids, shard_tokens=shard_tokens, group=group)
    if not torch.equal(resume.prompt_ids, ids.cpu()) or resume.shard_tokens != shard_tokens:
        raise ValueError(
            "the state to resume was computed for another prompt or shard size "
            f"(shard_tokens {resume.shard_tokens} vs {shard_tokens}); start a fresh prefill"
        )
    return resume


def sharded_prefill(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor | Sequence[int],
    *,
    shard_tokens: int,
    group: dist.ProcessGroup | None = None,
    on_shard: Callable[[PrefixState, int], None] | None = None,
    resume: PrefixState | None = None,
    start_shard: int = 0,
    end_shard: int | None = None,
) -> PrefixState:
    """This rank's slice of the prompt state of `prompt_ids[:-1]`; call on every rank together.

    `on_shard(state, s)` runs on the owner after its shard s is complete (persistence). To resume,
    pass `resume` (from `allocate_sharded_state`) holding every owned shard before `start_shard`
    (K/V and the end-of-shard linear checkpoints; shard 0's start state is zero) and the same
    `start_shard` on every rank: earlier shards are not recomputed, only the linear-state
    handoffs at their ownership boundaries are replayed (one constant-size broadcast each).
    `end_shard` (None: all) stops before that shard, so that a caller can compute the prompt a
    few shards at a time (`ShardedPrefillSession`); the final linear state reaches every rank
    once the last shard is done.
    """
    ids = _prompt_tensor(model, prompt_ids)
    state = prefill_target(
        model, ids, shard_tokens=shard_tokens, group=group, resume=resume, start_shard=start_shard
    )
    stop = state.num_shards if end_shard is None else end_shard
    if not start_shard <= stop <= state.num_shards:
        raise ValueError(
            f"end_shard {end_shard} must lie in [start_shard, num_shards] = "
            f"[{start_shard}, {state.num_shards}]"
        )
    with torch.no_grad(), cross_rank_attention_enabled(model):
        for shard in range(stop):
            # Also at restored boundaries: the start state of a rank's first shard is the previous
            # owner's end state, which that rank did not restore itself.
            _handoff_linear_state(state, shard, group)
            if shard < start_shard:
                continue
            owner = state.owner_of(shard)
            if owner == state.rank:
                cache = owner_prefill_cache(state, shard, group=group)
                start, end = state.bounds[shard]
                run_shard_forward(model, ids, cache, start, end)
                finish_owner(owner, group)
                if on_shard is not None:
                    on_shard(state, shard)
            else:
                serve_shard(model, state, shard, group=group)
        if stop == state.num_shards:
            broadcast_final_linear_state(state, group)
    return state
