"""Rollout over a sequence-sharded prompt state: G responses sampled in one batch on every rank.

Legend: G rows (samples), V vocab, N ranks.

The single-process `longstraw.engine.rollout.sample_responses`, replicated: every rank runs the
same batched decode with the same sampling parameters and a generator seeded the same way, so
every rank draws the same tokens. Per step and full-attention layer, the new queries' partial
attention over this rank's own prefix positions is all-gathered and merged by log-sum-exp in
rank order; the branch overlay (kept by the layers, `keep_branch=True`) enters once, merged after
the gather on every rank, as replicated replay merges its branch part
(`cross_rank_attention`). GLM-5's MLA layers decode the same way with the global DSA top-k
(`cross_rank_mla`). Gated DeltaNet layers decode from the replicated final state, forked per row.
No rank receives another rank's prefix state; the traffic per step is query-sized.

Identical draws rest on identical logits: the merge order is fixed and every rank computes the
same ops on the same inputs, so the logits are the same bits on every rank (as replicated replay's
log-probs are, tested). A rank that drew differently would leave the others blocked in a
collective or silently train on other responses, so each step all-gathers the G drawn ids (8·G
bytes per rank) and raises `ReplicaDivergenceError` on every rank if any rank drew otherwise.

The loop is the single-process one (`engine.rollout.sample_responses`); only the exchange
differs (`CrossRankExchange`: the decoding cache, the cross-rank attention, the draw check).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.exchange import CrossRankExchange, ReplicaDivergenceError
from longstraw.engine.rollout import Response, SamplingParams, sample_responses
from longstraw.engine.state import PrefixState

__all__ = ["ReplicaDivergenceError", "sharded_sample_responses"]


def sharded_sample_responses(
    model: PreTrainedModel,
    state: PrefixState,
    params: SamplingParams,
    *,
    group: dist.ProcessGroup | None = None,
    generator: torch.Generator | None = None,
    tokenizer=None,
) -> list[Response]:
    """`sample_responses` over this rank's slice of a sharded state; call on every rank of the
    sequence group with the same `params` and an identically seeded `generator`. Every rank
    returns the same responses."""
    return sample_responses(
        model,
        state,
        params,
        generator=generator,
        tokenizer=tokenizer,
        exchange=CrossRankExchange(group),
    )
