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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.utils.checkpoint
from transformers import PreTrainedModel

from longstraw.engine.attention import prefix_attention_enabled
from longstraw.engine.cache import StateCache
from longstraw.engine.delta_rule import delta_rule_backward_recomputed
from longstraw.engine.layer_kinds import sweep_layers
from longstraw.engine.prefill import run_shard_forward
from longstraw.engine.replay import PromptCotangent
from longstraw.engine.state import PrefixState, stored_slice
from longstraw.models.adapters import decoder_of
from longstraw.ops.blockwise_backward import BLOCK_TOKENS, rows_recomputed_in_blocks

# Tokens per block of the MLPs' and delta rule's backward in the sweep (read at each call).
SWEEP_BLOCK_TOKENS = BLOCK_TOKENS
# Set on the MLP forwards the sweep installs, so a nested `sweep_forward` does not wrap them twice.
_MARK = "longstraw_blockwise"


class RecomputedStateMismatchError(RuntimeError):
    """The recomputed shard did not reproduce the stored prompt state bitwise (a state whose
    recorded key does not match is `longstraw.storage.errors.StateKeyMismatchError`)."""


def _require_equal(name: str, recomputed: torch.Tensor, stored: torch.Tensor, shard: int) -> None:
    if not torch.equal(recomputed.detach(), stored):
        diff = (recomputed.detach().float() - stored.float()).abs()
        raise RecomputedStateMismatchError(
            f"shard {shard}: recomputed {name} differs from the stored prompt state "
            f"(max_diff {diff.max().item():.3e}, mean_diff {diff.mean().item():.3e}); the state was "
            "computed with other weights, dtype or kernels: recompute the prefill"
        )


# True while a shard's backward runs: layer checkpoints then recompute only to restore saved
# tensors, and the MLP's output is not one of them.
_LAYER_RECOMPUTE_SKIPS_MLP = [False]


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

        def blockwise(x, _fn=in_engine, _params=params):
            # While the layer checkpoint recomputes, only the MLP's saved input matters (the
            # node that backpropagates is the first forward's, with the real function), and
            # nothing after the MLP in a decoder layer saves a tensor: skip its computation.
            fn = _no_output if _LAYER_RECOMPUTE_SKIPS_MLP[0] else _fn
            return rows_recomputed_in_blocks(fn, x, _params, block_tokens=SWEEP_BLOCK_TOKENS)

        setattr(blockwise, _MARK, True)
        mlp.forward = blockwise
        undo.append(lambda mlp=mlp: delattr(mlp, "forward"))
    return undo


@contextlib.contextmanager
def sweep_forward(model: PreTrainedModel) -> Iterator[None]:
    """The forward the sweep recomputes: LongStraw's attention and routing, and the MLPs and
    delta rule that keep only their inputs and recompute block by block in backward
    (`longstraw.ops.blockwise_backward`): one layer's graph is then that of `BLOCK_TOKENS`
    tokens for its MLP and recurrence. Forwards are unchanged (the same functions on the same
    inputs), so the recomputed shard still reproduces the stored state bitwise.

    Re-entrant: the recomputations of activation checkpointing and of the blockwise backward
    run during backward, outside the caller's blocks, and enter this again.
    """
    with (
        prefix_attention_enabled(model),
        delta_rule_backward_recomputed(model, lambda: SWEEP_BLOCK_TOKENS),
        mlps_recomputed_in_blocks(model),
    ):
        yield


@contextlib.contextmanager
def mlps_recomputed_in_blocks(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block every decoder layer's MLP keeps only its input and recomputes
    `SWEEP_BLOCK_TOKENS` rows at a time in backward (no communication: the sharded sweep uses it
    beside its cross-rank attention)."""
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
    after_shard: Callable[[int], None] | None = None,
) -> None:
    """Backpropagate `cotangent` through every prefill shard, last to first (gradients → .grad)."""
    for shard in reversed(range(state.num_shards)):
        _sweep_shard(model, state, cotangent, shard)
        if after_shard is not None:
            after_shard(shard)


def _sweep_shard(
    model: PreTrainedModel, state: PrefixState, cotangent: PromptCotangent, shard: int
) -> None:
    """Recompute shard `shard` with autograd, check it, and backpropagate its cotangents."""
    spec = state.spec
    start, end = state.bounds[shard]
    outputs: list[tuple[str, int, torch.Tensor]] = []
    seen: set[tuple[str, int]] = set()

    def capture(kind: str, slot: int) -> Callable[..., None]:
        def record(*tensors: torch.Tensor) -> None:
            # Layer recomputation during backward calls the cache again: keep the first forward's.
            if (kind, slot) in seen:
                return
            seen.add((kind, slot))
            kinds = {"kv": ("k", "v"), "mla": ("latent", "rope_key", "indexer_key")}.get(
                kind, (kind,)
            )
            outputs.extend(
                (k, slot, t) for k, t in zip(kinds, tensors, strict=True) if t is not None
            )

        return record

    leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    layers = sweep_layers(
        state,
        cotangent,
        prefix_end=start,
        checkpoint=shard,
        leaves=leaves,
        kind_kwargs={
            "full_attention": lambda slot: {"on_update": capture("kv", slot)},
            "linear_attention": lambda slot: {
                "on_conv": capture("conv", slot),
                "on_recurrent": capture("recurrent", slot),
            },
            "mla": lambda slot: {"on_update": capture("mla", slot)},
        },
    )

    with torch.enable_grad(), sweep_forward(model), layerwise_recompute(model):
        cache = StateCache(layers, position_offset=start)
        run_shard_forward(model, state.prompt_ids, cache, start, end)

    tensors, grads = [], []
    for kind, slot, tensor in outputs:
        if kind == "k":
            stored = stored_slice(state.keys, slot, start, end)
            cot = stored_slice(cotangent.keys, slot, start, end)
            recomputed = tensor[0].transpose(0, 1)
        elif kind == "v":
            stored = stored_slice(state.values, slot, start, end)
            cot = stored_slice(cotangent.values, slot, start, end)
            recomputed = tensor[0].transpose(0, 1)
        elif kind in ("latent", "rope_key"):
            stored = stored_slice(getattr(state, kind), slot, start, end)
            cot = stored_slice(getattr(cotangent, kind), slot, start, end)
            recomputed = tensor[0]
        elif kind == "indexer_key":
            # No cotangent: the indexer runs under no_grad (checked, never backpropagated).
            layer_idx = spec.mla.layer_indices[slot]
            stored = stored_slice(state.indexer_key, spec.mla.indexer_slot(layer_idx), start, end)
            cot, recomputed = None, tensor[0]
        elif kind == "conv":
            stored, cot = state.conv[slot, shard + 1], cotangent.conv[slot]
            recomputed = tensor[0]
        else:
            stored, cot = state.recurrent[slot, shard + 1], cotangent.recurrent[slot]
            recomputed = tensor[0]
        _require_equal(f"{kind} of state slot {slot}", recomputed, stored, shard)
        if recomputed.requires_grad:
            tensors.append(recomputed)
            grads.append(cot.to(recomputed.dtype))
    if tensors:
        with _mlp_skipped_in_layer_recompute():
            torch.autograd.backward(tensors, grads)
    # The start state of this shard is read by nothing else: its cotangent replaces the end's.
    for slot, (conv_leaf, recurrent_leaf) in leaves.items():
        cotangent.conv[slot] = 0.0 if conv_leaf.grad is None else conv_leaf.grad.float()
        cotangent.recurrent[slot] = (
            0.0 if recurrent_leaf.grad is None else recurrent_leaf.grad.float()
        )
