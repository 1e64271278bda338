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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.cross_rank_attention import COMM, cross_rank_attention_enabled
from longstraw.distributed.sharded_replay import ShardedBranch
from longstraw.distributed.sharded_state import ShardedPrefixState
from longstraw.engine.attention import CACHE_KWARG
from longstraw.engine.cache import StateCache
from longstraw.engine.rollout import Response, SamplingParams, decode
from longstraw.engine.validation import check_positions


class ReplicaDivergenceError(RuntimeError):
    """Ranks of the sequence group drew different tokens in a replicated decode step."""


def _decode_logits(
    model: PreTrainedModel, input_ids_G1: torch.Tensor, cache: StateCache
) -> torch.Tensor:
    """[G, 1, V] logits of one decode step at position `cache.position_offset`."""
    rows, length = input_ids_G1.shape
    offset = cache.position_offset
    position_ids = torch.arange(offset, offset + length, device=model.device).expand(rows, -1)
    with cross_rank_attention_enabled(model):
        return model(
            input_ids=input_ids_G1.to(model.device),
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            **{CACHE_KWARG: cache},
        ).logits


def _check_same_draws(choice_G1: torch.Tensor, step: int, group) -> None:
    """Every rank drew the same G tokens at this step (else raise on every rank)."""
    draws = choice_G1.reshape(-1).to(torch.int64).contiguous()
    parts = [torch.empty_like(draws) for _ in range(dist.get_world_size(group))]
    COMM.add(draws)
    dist.all_gather(parts, draws, group=group)
    differ = [rank for rank, part in enumerate(parts) if not torch.equal(part, parts[0])]
    if differ:
        raise ReplicaDivergenceError(
            f"decode step {step}: ranks {differ} drew {[parts[r].tolist() for r in differ]}, "
            f"rank 0 drew {parts[0].tolist()}; seed every rank's generator identically and use "
            "the same model weights, dtype and sampling parameters on every rank"
        )


@torch.no_grad()
def sharded_sample_responses(
    model: PreTrainedModel,
    state: ShardedPrefixState,
    params: SamplingParams,
    *,
    group: dist.ProcessGroup | None = None,
    generator: torch.Generator | None = None,
    tokenizer=None,
) -> list[Response]:
    """`sample_responses` over this rank's slice of a sharded state; call on every rank of the
    sequence group with the same `params` and an identically seeded `generator`. Every rank
    returns the same responses."""
    check_positions(
        state.spec, state.prompt_len + params.max_new_tokens, what="prompt + max_new_tokens"
    )
    rows = params.num_samples
    cache = ShardedBranch(state, None, group, keep_branch=True, batch_size=rows).cache

    def next_logits(tokens_G1: torch.Tensor) -> torch.Tensor:
        logits_GV = _decode_logits(model, tokens_G1, cache)[:, -1]
        cache.position_offset += 1
        return logits_GV

    # The engine's own sampling loop (same generator calls in the same order), so a greedy
    # sharded rollout draws the single-process tokens.
    first_G1 = torch.full((rows, 1), state.last_token_id, dtype=torch.long, device=model.device)
    return decode(
        next_logits,
        first_G1,
        params,
        generator=generator,
        tokenizer=tokenizer,
        after_draw=lambda choice_G1, step: _check_same_draws(choice_G1, step, group),
    )
