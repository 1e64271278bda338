"""Exact mode's reverse sweep: push the prompt-state cotangent back through the prefill shards.

After every branch has been replayed, `cotangent` holds dL/dS for the K/V of every prompt
position (from the branches' attention) and for the final linear-attention state. For shard
s = last .. first: recompute the shard's forward with autograd, reading the K/V of earlier
positions from the state (gradient added into their cotangent slice by the prefix attention) and
starting the Gated DeltaNet layers from the checkpoint at the shard's start (a leaf); check that
the recomputation reproduced the stored state bitwise; backpropagate the shard's outputs — its
own K/V with the cotangent of its positions, its end state with the cotangent of the end state —
into the parameters, earlier K/V and the start state; free the graph.

When shard s is processed, its positions' cotangent is complete: only branches and later shards
read them, and both have been backpropagated. Memory: the state, its fp32 cotangent, one shard's
graph.

One sweep at every world size. On a sequence group each shard is recomputed by the rank that
holds it, through the cross-rank attention in owner mode; every other rank serves it, adding the
cotangent for ITS positions that the shard's queries read into its own slice of dS (so
contributions for earlier ranks' K/V land on those ranks without moving K/V). At an ownership
boundary the cotangent of the linear-attention start state goes back to the previous owner,
whose last shard's end state it is. The `PrefixExchange` supplies what differs (the attention,
the cache layers, the serving and the hand-back); one process owns every shard.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator

import torch
import torch.utils.checkpoint
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import SiLUActivation

from longstraw.engine.attention import prefix_attention_enabled
from longstraw.engine.cache import StateCache
from longstraw.engine.delta_rule import delta_rule_backward_recomputed
from longstraw.engine.exchange import LOCAL, PrefixExchange
from longstraw.engine.first_pass import first_pass_outputs_kept
from longstraw.engine.layer_kinds import sweep_layers
from longstraw.engine.prefill import run_shard_forward
from longstraw.engine.recomputed_span import (
    SpanOutputs,
    backward_recomputed_span,
    take_start_cotangent,
)
from longstraw.engine.replay import PromptCotangent
from longstraw.engine.state import PrefixState
from longstraw.models.adapters import decoder_of
from longstraw.models.lora import is_plain_linear, linear_parts
from longstraw.ops.blockwise_backward import (
    BLOCK_TOKENS,
    GatedMlp,
    LowRank,
    OutputProjection,
    rows_recomputed_in_blocks,
)

# Tokens per block of the delta rule's backward in the sweep (read at each call).
SWEEP_BLOCK_TOKENS = BLOCK_TOKENS
# The MLPs' backward in the sweep takes blocks of this many times `SWEEP_BLOCK_TOKENS` (read at
# each call): 512 rows of a 512-wide, 1536-intermediate gated MLP keep ~12 MB of graph and ran
# its backward 0.91x the time of 256-row blocks (fewer, larger matmuls; one thread, 2048 rows).
MLP_BLOCKS_PER_DELTA_RULE_BLOCK = 2
# Set on the MLP forwards the sweep installs, so a nested `sweep_forward` does not wrap them twice.
_MARK = "longstraw_blockwise"


# True while a shard's backward runs: layer checkpoints then recompute only to restore saved
# tensors, and the MLP's output is not one of them (the delta rule's output is, and is kept
# from the first forward, as the prefix attention's: `engine.first_pass`).
_LAYER_RECOMPUTE_SKIPS_MLP = [False]


def _in_shard_backward() -> bool:
    return _LAYER_RECOMPUTE_SKIPS_MLP[0]


def _no_output(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@contextlib.contextmanager
def _mlp_skipped_in_layer_recompute() -> Iterator[None]:
    previous = _LAYER_RECOMPUTE_SKIPS_MLP[0]
    _LAYER_RECOMPUTE_SKIPS_MLP[0] = True
    try:
        yield
    finally:
        _LAYER_RECOMPUTE_SKIPS_MLP[0] = previous


# The one line of transformers' gated MLPs (llama, qwen3, qwen3_5, qwen3_next's dense MLP):
# modules whose class forward is exactly this get their gradients by hand in the blockwise
# backward (`GatedMlp`, or `OutputProjection` for its down projection alone), so its recompute
# skips the down projection and builds no graph.
_GATED_MLP_LINE = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"


@functools.cache
def _is_gated_mlp_class(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return _GATED_MLP_LINE in source and source.count("self.") == 4


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, (nn.SiLU, SiLUActivation))


def _gated_mlp_split(mlp: nn.Module) -> GatedMlp | OutputProjection | None:
    """How the blockwise backward may take a gated MLP (down_proj of act(gate_proj(x)) *
    up_proj(x)) apart: all by hand (`GatedMlp`) for bias-free linear projections with a SiLU,
    each a plain `nn.Linear` or one with a LoRA adapter (peft's `lora.Linear`, whose low-rank
    path the backward takes by hand too: `models.lora.linear_parts`); else its down projection
    by hand (`OutputProjection`) when that one is a plain linear layer; None for any other
    MLP. A projection neither plain nor such an adapter (a wrapper whose forward adds to its
    weight) is never taken by hand: it runs as a module and autograd differentiates it."""
    if not _is_gated_mlp_class(type(mlp)):
        return None
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    parts = [linear_parts(p) for p in projections]
    if _is_silu(mlp.act_fn) and all(p is not None and p[0].bias is None for p in parts):
        low_rank = tuple(None if lr is None else LowRank(*lr) for _, lr in parts)
        return GatedMlp(*(base for base, _ in parts), low_rank=low_rank)
    if not is_plain_linear(mlp.down_proj):
        return None

    def inner(x: torch.Tensor) -> torch.Tensor:
        return mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)

    return OutputProjection(inner, mlp.down_proj)


def _patch_mlps(model: PreTrainedModel) -> list[Callable[[], None]]:
    """Route every decoder layer's MLP (token-wise, dense or MoE) through
    `rows_recomputed_in_blocks`. Returns the undo actions."""
    undo = []
    for layer in decoder_of(model).layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or getattr(mlp.forward, _MARK, False):
            continue
        params = [p for p in mlp.parameters() if p.requires_grad]

        def in_engine(x, _forward=mlp.forward):
            # The block recomputation runs during backward, outside every `with` of the sweep:
            # select LongStraw's (stable MoE) routing again. The MLP calls no delta rule and no
            # other MLP, so the sweep's patches are not needed here.
            with prefix_attention_enabled(model):
                return _forward(x)

        def blockwise(x, _fn=in_engine, _params=params, _split=_gated_mlp_split(mlp)):
            # While the layer checkpoint recomputes, only the MLP's saved input matters (the
            # node that backpropagates is the first forward's, with the real function), and
            # nothing after the MLP in a decoder layer saves a tensor: skip its computation.
            if _LAYER_RECOMPUTE_SKIPS_MLP[0]:
                return rows_recomputed_in_blocks(_no_output, x, _params)
            return rows_recomputed_in_blocks(
                _fn,
                x,
                _params,
                block_tokens=MLP_BLOCKS_PER_DELTA_RULE_BLOCK * SWEEP_BLOCK_TOKENS,
                split=_split,
            )

        setattr(blockwise, _MARK, True)
        mlp.forward = blockwise
        undo.append(lambda mlp=mlp: delattr(mlp, "forward"))
    return undo


@contextlib.contextmanager
def sweep_forward(model: PreTrainedModel, exchange: PrefixExchange = LOCAL) -> Iterator[None]:
    """The forward the sweep recomputes: LongStraw's attention (the exchange's: over this
    process's prefix or across the ranks) and routing, and the MLPs and delta rule that keep
    only their inputs and recompute block by block in backward
    (`longstraw.ops.blockwise_backward`): one layer's graph is then that of `BLOCK_TOKENS`
    tokens for its MLP and recurrence. Forwards are unchanged (the same functions on the same
    inputs), so the recomputed shard still reproduces the stored state bitwise.

    Re-entrant: the recomputations of activation checkpointing and of the blockwise backward
    run during backward, outside the caller's blocks, and enter this again.
    """
    with (
        exchange.layers.attention_enabled(model),
        delta_rule_backward_recomputed(model, lambda: SWEEP_BLOCK_TOKENS),
        mlps_recomputed_in_blocks(model),
    ):
        yield


@contextlib.contextmanager
def mlps_recomputed_in_blocks(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block every decoder layer's MLP keeps only its input and recomputes
    `SWEEP_BLOCK_TOKENS` rows at a time in backward (no communication)."""
    undo = _patch_mlps(model)
    try:
        yield
    finally:
        for action in reversed(undo):
            action()


@contextlib.contextmanager
def layerwise_recompute(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block, each decoder layer keeps only its input and recomputes its activations
    in backward (non-reentrant activation checkpointing), so a shard's graph holds
    [shard, hidden] per layer plus one layer's activations at a time, not every layer's.

    transformers' own gradient checkpointing cannot be used: in training mode it drops the cache
    inside each layer (docs/design.md). The cache layers of the sweep are recompute-safe: they start
    every forward from the shard-start state and record only the first forward's outputs.
    """
    layers = list(decoder_of(model).layers)
    for layer in layers:
        forward = layer.forward

        def run(*args, _forward=forward, **kwargs):
            with sweep_forward(model):
                return _forward(*args, **kwargs)

        def checkpointed(*args, _run=run, **kwargs):
            return torch.utils.checkpoint.checkpoint(_run, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def sweep_prompt_shards(
    model: PreTrainedModel,
    state: PrefixState,
    cotangent: PromptCotangent,
    *,
    exchange: PrefixExchange = LOCAL,
    swept: int = 0,
    after_shard: Callable[[int], None] | None = None,
    on_shard_done: Callable[[int], None] | None = None,
    on_gradient_slices: Callable[[int, int], None] | None = None,
) -> None:
    """Backpropagate `cotangent` through every prefill shard, last to first (gradients → .grad
    of the rank that holds each shard); on a sequence group, call on every rank.

    The linear-attention part of `cotangent` must be the final-state cotangent on the group's
    last rank (replay leaves it there; the copies on other ranks are discarded here). With
    `swept` > 0 the last `swept` shards are done already and `cotangent` is what a sweep held
    after them (`engine.sweep_checkpoint`): it continues with the shard before.
    `after_shard(shard)` runs on the shard's owner after its backward; `on_shard_done(shard)`
    on every rank once the shard is done there (its start-state cotangent handed back), where
    the sweep may be checkpointed. `on_gradient_slices`: while serving, answer the owner's
    gradient-slice headers (`longstraw.distributed.gradient_slices`).
    """
    if swept == 0 and cotangent.conv is not None and state.rank != state.world_size - 1:
        # Every rank replayed the same branches; only the last rank's copy is the real dS.
        cotangent.conv.zero_()
        cotangent.recurrent.zero_()
    with exchange.layers.attention_enabled(model):
        for shard in reversed(range(state.num_shards - swept)):
            if state.owner_of(shard) == state.rank:
                sweep_shard(model, state, cotangent, shard, exchange)
                exchange.shards.finish_owned_shard(state)
                if after_shard is not None:
                    after_shard(shard)
            else:
                exchange.shards.serve_shard(model, state, shard, cotangent, on_gradient_slices)
            if shard > 0 and state.owner_of(shard - 1) != state.owner_of(shard):
                exchange.shards.hand_back_start_cotangent(state, cotangent, shard)
            if on_shard_done is not None:
                on_shard_done(shard)


# What a mismatch between the recomputed and the stored prompt state means.
STATE_MISMATCH_REMEDY = (
    "the state was computed with other weights, dtype, kernels, ranks or shard size: recompute "
    "the prefill"
)


def sweep_shard(
    model: PreTrainedModel,
    state: PrefixState,
    cotangent: PromptCotangent,
    shard: int,
    exchange: PrefixExchange = LOCAL,
) -> None:
    """Recompute shard `shard` (held here) with autograd, check it bitwise against the stored
    state, and backpropagate its cotangents."""
    start, end = state.bounds[shard]
    outputs = SpanOutputs()
    leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    layers = sweep_layers(
        state,
        cotangent,
        prefix_end=state.local_prefix_end(shard),
        checkpoint=state.local_checkpoint(shard),
        leaves=leaves,
        record=outputs,
        kind_kwargs=exchange.layers.owner_kwargs(state, shard),
    )
    with first_pass_outputs_kept(_in_shard_backward):
        # Each decoder layer keeps only its input and recomputes in backward, where the
        # placement allows it (on ranks a layer's recomputation would read the prefix again).
        recompute = (
            layerwise_recompute(model)
            if exchange.shards.recomputes_layers
            else contextlib.nullcontext()
        )
        with torch.enable_grad(), sweep_forward(model, exchange), recompute:
            cache = StateCache(layers, position_offset=start)
            run_shard_forward(model, state.prompt_ids, cache, start, end)
        with exchange.layers.attention_enabled(model), _mlp_skipped_in_layer_recompute():
            backward_recomputed_span(
                outputs,
                state,
                cotangent,
                rows=state.local_rows(start, end),
                end_checkpoint=state.local_checkpoint(shard) + 1,
                what=exchange.shards.shard_name(state, shard),
                remedy=STATE_MISMATCH_REMEDY,
            )
    take_start_cotangent(leaves, cotangent)
