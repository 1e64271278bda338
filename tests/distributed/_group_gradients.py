"""A group's gradient on the ranks of a sequence group, as the tests call it (every rank, same
arguments, inside `run_on_ranks`).

`group_gradient_on_ranks` is the engine's one `engine.group.group_gradient` over
`CrossRankExchange(group)`, with the group's inputs checked as the training stage checks them:
this rank's fp32 rows of the gradient (`GradSlices`), what training runs.

`dense_group_gradients` is the tests' reference for those rows: the same replay and sweep
(`engine.group.replay_and_sweep` over the same exchange) into two dense fp32 buffers per rank —
the replicated branches' and this rank's sweep shards' —, then one all-reduce over the sequence
group in which only its first rank adds the branch part (every rank computed the same branches),
and an average over `data_group`. Every rank ends with the whole gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from longstraw.distributed.exchange import CrossRankExchange
from longstraw.distributed.gradient_slices import GradSlices
from longstraw.distributed.topology import Topology
from longstraw.engine.gradient_sink import (
    drain_grads_into,
    grads_drained_into,
    trainable_parameters,
)
from longstraw.engine.group import GradBuffer, group_gradient, group_inputs, replay_and_sweep
from longstraw.engine.state import PrefixState
from longstraw.schemas.grpo import GRPOConfig
from longstraw.schemas.run import EngineConfig


def group_gradient_on_ranks(
    model: PreTrainedModel,
    state: PrefixState,
    responses: Sequence[torch.Tensor],
    advantages: torch.Tensor | Sequence[float],
    loss_config: GRPOConfig,
    *,
    prompt_grad: str = "exact",
    group: dist.ProcessGroup | None = None,
    topology: Topology | None = None,
    branch_segment_tokens: int | None = None,
    share_response_prefixes: bool = False,
    **inputs,
) -> tuple[GradSlices, list[torch.Tensor]]:
    """(this rank's fp32 rows of the group's gradient, per-branch log-probs [G][R_i]);
    `inputs` are `engine.group.group_inputs`'s (old and reference log-probs, loss masks,
    importance weights, the normaliser), `topology` the run's ranks when `group` is one replica's
    sequence group (the rows are laid out for the replicas: `gradient_slices.SliceLayout`).
    `.grad` of the parameters is left untouched."""
    checked = group_inputs(
        model, responses, advantages, loss_config, prompt_grad=prompt_grad, **inputs
    )
    engine = EngineConfig(
        prompt_grad=prompt_grad,
        branch_segment_tokens=branch_segment_tokens,
        share_response_prefixes=share_response_prefixes,
    )
    slices, stats = group_gradient(
        model, state, checked, loss_config, engine,
        exchange=CrossRankExchange(group, topology=topology),
    )  # fmt: skip
    return slices, [torch.tensor(lp, dtype=torch.float32) for lp in stats.branch_logprobs]


def dense_group_gradients(
    model: PreTrainedModel,
    state: PrefixState,
    responses: Sequence[torch.Tensor],
    advantages: torch.Tensor | Sequence[float],
    loss_config: GRPOConfig,
    *,
    prompt_grad: str = "exact",
    group: dist.ProcessGroup | None = None,
    data_group: dist.ProcessGroup | None = None,
    branch_segment_tokens: int | None = None,
    share_response_prefixes: bool = False,
    **inputs,
) -> tuple[GradBuffer, list[torch.Tensor]]:
    """(the group's whole fp32 gradient — the same on every rank —, per-branch log-probs
    [G][R_i]); the same checks, loss weights and order as the engine. `.grad` of the parameters
    is left untouched."""
    checked = group_inputs(
        model, responses, advantages, loss_config, prompt_grad=prompt_grad, **inputs
    )
    params = trainable_parameters(model)
    branch, sweep = GradBuffer(model), GradBuffer(model)
    record = replay_and_sweep(
        model, state, checked, loss_config, prompt_grad,
        replay_sink=grads_drained_into(params, branch),
        exchange=CrossRankExchange(group), segment_tokens=branch_segment_tokens,
        share_prefixes=share_response_prefixes,
        after_shard=lambda _: drain_grads_into(params, sweep),
    )  # fmt: skip
    first = dist.get_rank(group) == 0
    for name, grad in sweep.grads.items():
        if first:
            grad += branch.grads[name]
        dist.all_reduce(grad, group=group)
        if data_group is not None:
            dist.all_reduce(grad, group=data_group)
            grad /= dist.get_world_size(data_group)
    return sweep, record.logprobs
