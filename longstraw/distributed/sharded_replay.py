"""Branch replay and exact reverse sweep over a sequence-sharded prompt state.

Replay (replicated): every rank runs the same branch forward and backward; its full-attention
layers read the prefix through the cross-rank attention (partials all-gathered, dq all-reduced),
so each rank's prompt-state cotangent dS stays local: rank r accumulates dK/dV (GLM-5: d latent,
d rope key, `cross_rank_mla`) only for the positions it holds. The Gated DeltaNet layers start from the final state every rank keeps.

Reverse sweep (exact mode): global shards last to first; the owner recomputes its shard with
autograd through the cross-rank attention in owner mode, checks it bitwise against its stored
slice, and backpropagates; every other rank serves, adding the cotangent for ITS positions that
the shard's queries read into its own dS slice (so contributions for earlier ranks' K/V land on
those ranks without moving K/V). At an ownership boundary the cotangent of the linear-attention
start state is broadcast back to the previous owner, whose last shard's end state it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.cross_rank_attention import (
    CrossRankAttentionLayer,
    cross_rank_attention_enabled,
    finish_owner,
)
from longstraw.distributed.cross_rank_mla import CrossRankMlaLayer
from longstraw.distributed.exchange import CrossRankExchange, cross_rank_kind_kwargs
from longstraw.distributed.sharded_prefill import local_prefix_end, serve_shard
from longstraw.engine.cache import ForkedLinearAttentionLayer, StateCache
from longstraw.engine.delta_rule import delta_rule_backward_recomputed
from longstraw.engine.layer_kinds import CHECKPOINT_ARRAYS, branch_layers, sweep_layers
from longstraw.engine.prefill import run_shard_forward
from longstraw.engine.recomputed_span import (
    SpanOutputs,
    backward_recomputed_span,
    take_start_cotangent,
)
from longstraw.engine.replay import (
    PromptCotangent,
    branch_input_ids,
    replay_logits,
    token_logprobs,
)
from longstraw.engine.state import PrefixState
from longstraw.engine.sweep import mlps_recomputed_in_blocks
from longstraw.ops.blockwise_backward import BLOCK_TOKENS


def zeros_cotangent(state: PrefixState) -> PromptCotangent:
    """fp32 dS for this rank's slice: K/V (or MLA latents and rope keys) of its positions, and
    the linear state (constant); in the slice's lower tier when it is tiered. Indexer keys have
    none (the indexer runs under no_grad)."""
    return PromptCotangent.zeros_like_state(state)


class ShardedBranch:
    """One branch's cache on this rank and the linear-attention leaves it forked (exact mode).

    `keep_branch` / `batch_size` (decoding, `sharded_rollout`): the attention layers keep the
    branch's own K/V (latents) between steps and the forked linear state has `batch_size` rows.
    """

    def __init__(
        self,
        state: PrefixState,
        cotangent: PromptCotangent | None,
        group,
        *,
        keep_branch: bool = False,
        batch_size: int = 1,
    ) -> None:
        self.leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        layers = branch_layers(
            state,
            cotangent,
            leaves=self.leaves,
            batch_size=batch_size,
            kind_kwargs=cross_rank_kind_kwargs(state, group, keep_branch=keep_branch),
        )
        self.cache = StateCache(layers, position_offset=state.num_tokens)

    def add_leaf_grads_into(self, cotangent: PromptCotangent) -> None:
        for slot, (conv, recurrent) in self.leaves.items():
            if conv.grad is not None:
                cotangent.conv[slot] += conv.grad.float()
            if recurrent.grad is not None:
                cotangent.recurrent[slot] += recurrent.grad.float()


def sharded_branch_logprobs(
    model: PreTrainedModel,
    state: PrefixState,
    response_ids: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    cotangent: PromptCotangent | None = None,
) -> tuple[torch.Tensor, ShardedBranch]:
    """[R] fp32 log-probs of the response, the same bits on every rank; call on all ranks.

    With `cotangent`, the backward adds this rank's slice of dS; then call
    `branch.add_leaf_grads_into(cotangent)` for the linear-attention part.
    """
    branch = ShardedBranch(state, cotangent, group)
    response = response_ids.to(model.device)
    input_ids = branch_input_ids(state, response).unsqueeze(0)
    logits = replay_logits(model, state, input_ids, branch.cache, CrossRankExchange(group))
    return token_logprobs(logits, response.unsqueeze(0), temperature)[0], branch


def _sweep_owned_shard(
    model: PreTrainedModel,
    state: PrefixState,
    cotangent: PromptCotangent,
    shard: int,
    group,
) -> None:
    """Recompute `shard` (owned here) with autograd, check it, backpropagate its cotangents."""
    start, end = state.bounds[shard]
    offset = state.token_start
    local = shard - state.shards[0]
    outputs = SpanOutputs()
    leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    # As the single-process sweep: the MLPs and the delta rule keep only their inputs and
    # recompute block by block in backward, so the shard's graph holds no MLP activations.
    with (
        torch.enable_grad(),
        cross_rank_attention_enabled(model),
        delta_rule_backward_recomputed(model, lambda: BLOCK_TOKENS),
        mlps_recomputed_in_blocks(model),
    ):
        ranks = {"group": group, "owner": state.rank}
        layers = sweep_layers(
            state,
            cotangent,
            prefix_end=local_prefix_end(state, shard),
            checkpoint=local,
            leaves=leaves,
            record=outputs,
            kind_kwargs={
                "full_attention": lambda slot: {
                    "layer_class": CrossRankAttentionLayer,
                    "slot": slot,
                    **ranks,
                },
                "linear_attention": {"layer_class": ForkedLinearAttentionLayer},
                "mla": {
                    "layer_class": CrossRankMlaLayer,
                    "num_prefix": start,
                    "local_start": offset,
                    **ranks,
                },
            },
        )
        cache = StateCache(layers, position_offset=start)
        run_shard_forward(model, state.prompt_ids, cache, start, end)
    with cross_rank_attention_enabled(model):
        backward_recomputed_span(
            outputs,
            state,
            cotangent,
            rows=slice(start - offset, end - offset),
            end_checkpoint=local + 1,
            what=f"shard {shard} on rank {state.rank}",
            remedy="recompute the sharded prefill with the same weights, dtype, ranks and shard size",
        )
    take_start_cotangent(leaves, cotangent)


def _hand_back_linear_cotangent(
    state: PrefixState, cotangent: PromptCotangent, shard: int, group
) -> None:
    """After sweeping `shard`: if it starts its owner's range, its start-state cotangent is the
    end-state cotangent of the previous owner's last shard; send it there."""
    if cotangent.conv is None or shard == 0:
        return
    owner, previous = state.owner_of(shard), state.owner_of(shard - 1)
    if owner == previous:
        return
    for array in CHECKPOINT_ARRAYS:
        buffer = getattr(cotangent, array.field)
        incoming = buffer if state.rank == owner else torch.empty_like(buffer)
        dist.broadcast(incoming, group=group, group_src=owner)
        if state.rank == previous:
            buffer.copy_(incoming)


def sharded_sweep(
    model: PreTrainedModel,
    state: PrefixState,
    cotangent: PromptCotangent,
    *,
    group: dist.ProcessGroup | None = None,
    after_shard: Callable[[int], None] | None = None,
    on_gradient_slices: Callable[[int, int], None] | None = None,
) -> None:
    """Backpropagate dS through every prefill shard, last to first; call on every rank.

    Parameter gradients land in `.grad` on the rank that owns each shard. The linear-attention
    part of `cotangent` must be the final-state cotangent on the last rank (replay leaves it
    there; the copies on other ranks are discarded here).

    `on_gradient_slices(owner, index)`: while serving, answer the owner's `OP_GRADIENT_SLICES`
    headers (`longstraw.distributed.gradient_slices`: the owner's post-accumulate hooks scatter
    each parameter's gradient rows during its backward).
    """
    if cotangent.conv is not None and state.rank != state.world_size - 1:
        # Every rank replayed the same branches; only the last rank's copy is the real dS.
        cotangent.conv.zero_()
        cotangent.recurrent.zero_()
    with cross_rank_attention_enabled(model):
        for shard in reversed(range(state.num_shards)):
            owner = state.owner_of(shard)
            if owner == state.rank:
                _sweep_owned_shard(model, state, cotangent, shard, group)
                finish_owner(owner, group)
                if after_shard is not None:
                    after_shard(shard)
            else:
                serve_shard(
                    model, state, shard, group=group, cotangent=cotangent,
                    on_gradient_slices=on_gradient_slices,
                )  # fmt: skip
            _hand_back_linear_cotangent(state, cotangent, shard, group)
