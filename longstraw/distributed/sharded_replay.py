"""Branch replay over a sequence-sharded prompt state (the reverse sweep is `engine.sweep`'s,
over the ranks' exchange).

Replay (replicated): every rank runs the same branch forward and backward; its full-attention
layers read the prefix through the cross-rank attention (partials all-gathered, dq all-reduced),
so each rank's prompt-state cotangent dS stays local: rank r accumulates dK/dV (GLM-5: d latent,
d rope key, `cross_rank_mla`) only for the positions it holds. The Gated DeltaNet layers start
from the final state every rank keeps.

"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.exchange import CrossRankExchange, cross_rank_kind_kwargs
from longstraw.engine.cache import StateCache
from longstraw.engine.layer_kinds import branch_layers
from longstraw.engine.replay import (
    PromptCotangent,
    branch_input_ids,
    replay_logits,
    token_logprobs,
)
from longstraw.engine.state import PrefixState


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
