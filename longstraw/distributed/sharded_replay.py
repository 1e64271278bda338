"""Branch replay over a sequence-sharded prompt state: `engine.replay`'s over the ranks' exchange
(as the reverse sweep is `engine.sweep`'s).

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

from longstraw.distributed.exchange import CrossRankExchange
from longstraw.engine.replay import BranchCache, PromptCotangent, replay_branch
from longstraw.engine.state import PrefixState


def zeros_cotangent(state: PrefixState) -> PromptCotangent:
    """fp32 dS for this rank's slice: K/V (or MLA latents and rope keys) of its positions, and
    the linear state (constant); in the slice's lower tier when it is tiered. Indexer keys have
    none (the indexer runs under no_grad)."""
    return PromptCotangent.zeros_like_state(state)


def sharded_branch_logprobs(
    model: PreTrainedModel,
    state: PrefixState,
    response_ids: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    cotangent: PromptCotangent | None = None,
) -> tuple[torch.Tensor, BranchCache]:
    """[R] fp32 log-probs of the response, the same bits on every rank, and the branch's cache:
    `engine.replay.replay_branch` over the ranks of `group`; call on all ranks.

    With `cotangent`, the backward adds this rank's slice of dS; then call
    `branch.add_leaf_grads_into(cotangent)` for the linear-attention part.
    """
    return replay_branch(
        model, state, response_ids, temperature=temperature, cotangent=cotangent,
        exchange=CrossRankExchange(group),
    )  # fmt: skip
