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

from longstraw.distributed.gradient_slices import (
    GradSlices,
    SliceLayout,
    receive_gradient_slices,
    slices_drained_into,
    slices_scattered_from_owner,
)
from longstraw.distributed.sharded_replay import (
    sharded_branch_logprobs,
    sharded_sweep,
    zeros_cotangent,
)
from longstraw.distributed.sharded_state import ShardedPrefixState
from longstraw.engine.group import (
    GradBuffer,
    deterministic_when_exact,
    drain_grads_into,
    grads_drained_into,
    grads_set_aside,
    trainable_parameters,
)
from longstraw.grpo.losses import branch_loss, sequence_weights
from longstraw.schemas.grpo import GRPOConfig


def reduce_gradients(
    branch: GradBuffer,
    sweep: GradBuffer,
    *,
    sequence_group: dist.ProcessGroup | None = None,
    data_group: dist.ProcessGroup | None = None,
) -> GradBuffer:
    """Sum over the sequence group (branch part from its rank 0 only), average over data."""
    first = dist.get_rank(sequence_group) == 0
    for name, grad in sweep.grads.items():
        if first:
            grad += branch.grads[name]
        dist.all_reduce(grad, group=sequence_group)
        if data_group is not None:
            dist.all_reduce(grad, group=data_group)
            grad /= dist.get_world_size(data_group)
    return sweep


def _branch_inputs(
    responses, advantages, loss_config, prompt_grad, old_logprobs, loss_masks,
    num_items_in_batch, num_sequences_in_batch,
):  # fmt: skip
    """(masks [G], old log-probs [G], loss weights [G], advantages [G]) — checked."""
    if prompt_grad not in ("exact", "detached"):
        raise ValueError(f"prompt_grad must be 'exact' or 'detached', got {prompt_grad!r}")
    if loss_config.beta != 0.0:
        raise ValueError("sharded_group_gradients does not take ref_logprobs yet; set beta=0.0")
    num = len(responses)
    masks = (
        [None] * num
        if loss_masks is None
        else [torch.as_tensor(m, dtype=torch.float32) for m in loss_masks]
    )
    olds = [None] * num if old_logprobs is None else list(old_logprobs)
    lengths = [
        int(r.numel()) if m is None else int(m.sum()) for r, m in zip(responses, masks, strict=True)
    ]
    weights_G = sequence_weights(
        loss_config.loss_type,
        lengths,
        loss_config,
        num_items_in_batch=num_items_in_batch,
        num_sequences_in_batch=num_sequences_in_batch,
    )
    advantages_G = torch.as_tensor(advantages, dtype=torch.float32).flatten()
    return masks, olds, weights_G, advantages_G


def _replay_branches(model, state, responses, inputs, loss_config, group, cotangent):
    """Replay every branch (replicated on the ranks of `group`) and backpropagate its loss; the
    caller decides where parameter gradients go (hooks). Returns the log-probs [G][R_i]."""
    masks, olds, weights_G, advantages_G = inputs
    logps = []
    for i, response in enumerate(responses):
        logp, branch = sharded_branch_logprobs(
            model,
            state,
            response,
            group=group,
            temperature=loss_config.temperature,
            cotangent=cotangent,
        )
        old = None if olds[i] is None else torch.as_tensor(olds[i], dtype=logp.dtype)
        loss, _ = branch_loss(
            logp, old, float(advantages_G[i]), weights_G[i], loss_config, None, masks[i]
        )
        loss.backward()
        if cotangent is not None:
            branch.add_leaf_grads_into(cotangent)
        logps.append(logp.detach())
        del logp, loss, branch
    return logps


def sharded_group_gradients(
    model: PreTrainedModel,
    state: ShardedPrefixState,
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
) -> tuple[GradBuffer, list[torch.Tensor]]:
    """(the reduced fp32 gradient — the same on every rank —, per-branch log-probs [G][R_i]).

    Call on every rank of `group` with the same arguments. Mirrors
    `longstraw.engine.group.accumulate_group_gradients` (same loss weights and order), with
    `ref_logprobs` not yet plumbed (beta must be 0). `.grad` of the parameters is left untouched.
    """
    inputs = _branch_inputs(
        responses, advantages, loss_config, prompt_grad, old_logprobs, loss_masks,
        num_items_in_batch, num_sequences_in_batch,
    )  # fmt: skip
    params = trainable_parameters(model)
    branch_grads, sweep_grads = GradBuffer(model), GradBuffer(model)
    cotangent = zeros_cotangent(state) if prompt_grad == "exact" else None
    with grads_set_aside(params), deterministic_when_exact(prompt_grad):
        with grads_drained_into(params, branch_grads):
            logps = _replay_branches(model, state, responses, inputs, loss_config, group, cotangent)
        if cotangent is not None:
            sharded_sweep(
                model,
                state,
                cotangent,
                group=group,
                after_shard=lambda _: drain_grads_into(params, sweep_grads),
            )
    reduced = reduce_gradients(
        branch_grads, sweep_grads, sequence_group=group, data_group=data_group
    )
    return reduced, logps


def sharded_group_gradient_slices(
    model: PreTrainedModel,
    state: ShardedPrefixState,
    responses: Sequence[torch.Tensor],
    advantages: torch.Tensor | Sequence[float],
    loss_config: GRPOConfig,
    *,
    prompt_grad: str = "exact",
    group: dist.ProcessGroup | None = None,
    data_size: int = 1,
    old_logprobs: Sequence[torch.Tensor] | None = None,
    loss_masks: Sequence[torch.Tensor] | None = None,
    num_items_in_batch: float | None = None,
    num_sequences_in_batch: int | None = None,
) -> tuple[GradSlices, list[torch.Tensor]]:
    """`sharded_group_gradients` with sequence-sharded accumulators: (THIS rank's fp32 slices of
    the group's gradient, per-branch log-probs [G][R_i]).

    The slices of the ranks of `group` partition every parameter's dim-0 rows
    (`gradient_slices.SliceLayout`; `data_size` = the data replicas they will be averaged over,
    so that with FSDP over data × seq each rank ends with exactly its DTensor shard,
    `fsdp.set_sharded_gradients`). Each rank holds one accumulator of about 1/N_s of the fp32
    gradient instead of two dense ones; branch gradients are sliced where autograd accumulates
    them (no traffic), sweep gradients are scattered from the shard's owner per parameter.
    Not reduced over data. `.grad` of the parameters is left untouched.
    """
    inputs = _branch_inputs(
        responses, advantages, loss_config, prompt_grad, old_logprobs, loss_masks,
        num_items_in_batch, num_sequences_in_batch,
    )  # fmt: skip
    layout = SliceLayout(dist.get_rank(group), dist.get_world_size(group), data_size)
    params = trainable_parameters(model)
    slices = GradSlices(model, layout)
    cotangent = zeros_cotangent(state) if prompt_grad == "exact" else None
    with grads_set_aside(params), deterministic_when_exact(prompt_grad):
        with slices_drained_into(params, slices):
            logps = _replay_branches(model, state, responses, inputs, loss_config, group, cotangent)
        if cotangent is not None:
            with slices_scattered_from_owner(params, slices, group=group):
                sharded_sweep(
                    model,
                    state,
                    cotangent,
                    group=group,
                    on_gradient_slices=receive_gradient_slices(params, slices, group=group),
                )
    return slices, logps
