"""One GRPO group's gradient with the prompt state split across the ranks of `group`.

Which rank's gradient is what (and so what the reduction must do):

* Branch replay runs REPLICATED: every rank computes the same branch forward/backward, and the
  dq all-reduce inside the cross-rank attention makes every rank's branch gradient the full one,
  identical on all ranks. It is counted once: only rank 0 of the sequence group contributes it.
* The exact reverse sweep recomputes each prefill shard on its owner only, so the parameter
  gradient through shard s lives on owner(s): these partial gradients are SUMMED over ranks.
* Data-parallel replicas (other prompts on other sequence groups) AVERAGE on top: pass
  `data_group`; the normaliser (`num_items_in_batch`, ...) must already be global.

So one all_reduce(sum) over the sequence group of (branch if rank 0 else 0) + sweep gives every
rank the group's gradient; one all_reduce over the data group divided by its size averages.

`sharded_group_gradients` (the reference) holds two dense fp32 accumulators per rank;
`sharded_group_gradient_slices` holds one accumulator of about 1/N_s: each rank keeps only its
dim-0 rows of every parameter's gradient (`gradient_slices`), the branch counted once because the
rows partition, the sweep's gradient scattered from each shard's owner parameter by parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.exchange import CrossRankExchange
from longstraw.distributed.gradient_slices import GradSlices
from longstraw.engine.group import (
    GradBuffer,
    ReplayRecord,
    drain_grads_into,
    grads_drained_into,
    group_gradient,
    group_inputs,
    replay_and_sweep,
    trainable_parameters,
)
from longstraw.engine.state import PrefixState
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig


def all_reduce_rank_gradients(
    branch: GradBuffer,
    sweep: GradBuffer,
    *,
    sequence_group: dist.ProcessGroup | None = None,
    data_group: dist.ProcessGroup | None = None,
) -> GradBuffer:
    """Sum over the sequence group (branch part from its rank 0 only), average over data: the
    cross-rank reduction inside one group's step. (The training stage `reduce_gradients` sums
    the stored contributions of a step's groups.)"""
    first = dist.get_rank(sequence_group) == 0
    for name, grad in sweep.grads.items():
        if first:
            grad += branch.grads[name]
        dist.all_reduce(grad, group=sequence_group)
        if data_group is not None:
            dist.all_reduce(grad, group=data_group)
            grad /= dist.get_world_size(data_group)
    return sweep


def sharded_group_gradients(
    model: PreTrainedModel,
    state: PrefixState,
    responses: Sequence[torch.Tensor],
    advantages: torch.Tensor | Sequence[float],
    loss_config: GRPOConfig,
    **options,
) -> tuple[GradBuffer, list[torch.Tensor]]:
    """(the reduced fp32 gradient — the same on every rank —, per-branch log-probs [G][R_i]).

    Call on every rank of `group` with the same arguments; `options` are those of
    `sharded_group_replay`. Mirrors `longstraw.engine.group.accumulate_group_gradients` (same
    checks, loss weights and order). `.grad` of the parameters is left untouched.
    """
    reduced, record = sharded_group_replay(
        model, state, responses, advantages, loss_config, **options
    )
    return reduced, record.logprobs


def sharded_group_replay(
    model: PreTrainedModel,
    state: PrefixState,
    responses: Sequence[torch.Tensor],
    advantages: torch.Tensor | Sequence[float],
    loss_config: GRPOConfig,
    *,
    prompt_grad: str = "exact",
    group: dist.ProcessGroup | None = None,
    data_group: dist.ProcessGroup | None = None,
    old_logprobs: Sequence[torch.Tensor] | None = None,
    loss_masks: Sequence[torch.Tensor] | None = None,
    num_items_in_batch: float | None = None,
    num_sequences_in_batch: int | None = None,
    ref_logprobs: Sequence[torch.Tensor] | None = None,
    importance_weights: Sequence[torch.Tensor] | None = None,
    branch_segment_tokens: int | None = None,
    share_response_prefixes: bool = False,
) -> tuple[GradBuffer, ReplayRecord]:
    """`sharded_group_gradients` with the replay's log-probs, losses and loss statistics.

    `branch_segment_tokens` / `share_response_prefixes`: the run config's `engine` options of the
    same names, as in `accumulate_group_gradients` (`engine.group.replay_group_branches`)."""
    # The single-process path's front door: the same checks and the same loss weights.
    inputs = group_inputs(
        model, responses, advantages, loss_config, prompt_grad=prompt_grad,
        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, loss_masks=loss_masks,
        num_items_in_batch=num_items_in_batch, num_sequences_in_batch=num_sequences_in_batch,
        importance_weights=importance_weights,
    )  # fmt: skip
    params = trainable_parameters(model)
    branch_grads, sweep_grads = GradBuffer(model), GradBuffer(model)
    record = replay_and_sweep(
        model, state, inputs, loss_config, prompt_grad,
        replay_sink=grads_drained_into(params, branch_grads),
        exchange=CrossRankExchange(group), segment_tokens=branch_segment_tokens,
        share_prefixes=share_response_prefixes,
        after_shard=lambda _: drain_grads_into(params, sweep_grads),
    )  # fmt: skip
    reduced = all_reduce_rank_gradients(
        branch_grads, sweep_grads, sequence_group=group, data_group=data_group
    )
    return reduced, record


def sharded_group_gradient_slices(
    model: PreTrainedModel,
    state: PrefixState,
    responses: Sequence[torch.Tensor],
    advantages: torch.Tensor | Sequence[float],
    loss_config: GRPOConfig,
    *,
    prompt_grad: str = "exact",
    group: dist.ProcessGroup | None = None,
    data_size: int = 1,
    branch_segment_tokens: int | None = None,
    share_response_prefixes: bool = False,
    **inputs,
) -> tuple[GradSlices, list[torch.Tensor]]:
    """`sharded_group_gradients` with sequence-sharded accumulators: (THIS rank's fp32 slices of
    the group's gradient, per-branch log-probs [G][R_i]) — `engine.group.group_gradient` over
    `CrossRankExchange(group)`; `inputs` are `engine.group.group_inputs`'s (old and ref
    log-probs, loss masks, importance weights, the normaliser).

    The slices of the ranks of `group` partition every parameter's dim-0 rows
    (`gradient_slices.SliceLayout`; `data_size` = the data replicas they will be averaged over,
    so that with FSDP over data × seq each rank ends with exactly its DTensor shard,
    `fsdp.set_sharded_gradients`). Each rank holds one accumulator of about 1/N_s of the fp32
    gradient instead of two dense ones; branch gradients are sliced where autograd accumulates
    them (no traffic), sweep gradients are scattered from the shard's owner per parameter.
    Not reduced over data. `.grad` of the parameters is left untouched.
    """
    checked = group_inputs(
        model, responses, advantages, loss_config, prompt_grad=prompt_grad, **inputs
    )
    engine = EngineConfig(
        prompt_grad=prompt_grad,
        branch_segment_tokens=branch_segment_tokens,
        share_response_prefixes=share_response_prefixes,
    )
    slices, stats = group_gradient(
        model, state, checked, loss_config, engine, exchange=CrossRankExchange(group),
        data_size=data_size,
    )  # fmt: skip
    return slices, [torch.tensor(lp, dtype=torch.float32) for lp in stats.branch_logprobs]
