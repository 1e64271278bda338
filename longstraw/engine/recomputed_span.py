"""Backpropagate a span recomputed from stored state: one function for every checkpointed span.

Three places checkpoint a sequence by its own stored state and walk it back span by span: the
reverse sweep over prefill shards (one process, and the owner rank of a sharded state) and the
segments of a long branch. Each recomputes one span under autograd from the state before it,
and then does the same thing, written here once:

1. collect the span's new state from the cache layers' hooks (`SpanOutputs`, through each
   layer kind's `output_hooks`), in the state's own layout;
2. check it bitwise against what the forward stored (a mismatch means other weights, dtype or
   kernels: the stored state is not this model's);
3. backpropagate its per-token arrays with their cotangent (complete by now: only later spans
   and branches read them) and its end checkpoint with the cotangent handed back by the span
   after it, plus any extra outputs (a segment's log-probs);
4. the leaves of the span's start checkpoint then carry the cotangent of that checkpoint: it
   replaces the end's (`take_start_cotangent`), ready for the span before.

Legend: L layers of one kind, rows the span's positions in the holder's arrays (a rank's local
rows for a sharded state), N checkpoint entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longstraw.engine.layer_kinds import StateArray
from longstraw.engine.state import stored_slice


class RecomputedStateMismatchError(RuntimeError):
    """The recomputed span did not reproduce the stored state bitwise (a state whose recorded
    key does not match is `longstraw.storage.errors.StateKeyMismatchError`)."""


def require_equal(what: str, recomputed: torch.Tensor, stored: torch.Tensor, remedy: str) -> None:
    """Raise `RecomputedStateMismatchError` naming `what` and `remedy` unless bitwise equal."""
    if not torch.equal(recomputed.detach(), stored):
        diff = (recomputed.detach().float() - stored.float()).abs()
        raise RecomputedStateMismatchError(
            f"{what} differs from the stored state (max_diff {diff.max().item():.3e}, "
            f"mean_diff {diff.mean().item():.3e}); {remedy}"
        )


class SpanOutputs:
    """The new state a recomputed span hands to its cache layers' hooks (a `Record`).

    Only the first forward's outputs of each array slot are kept: activation checkpointing
    recomputes a layer during backward and calls its hooks again.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[StateArray, int, torch.Tensor]] = []
        self._seen: set[tuple[str, int]] = set()

    def __call__(self, entries: list[tuple[StateArray, int, torch.Tensor]]) -> None:
        for array, slot, tensor in entries:
            if (array.field, slot) not in self._seen:
                self._seen.add((array.field, slot))
                self.entries.append((array, slot, tensor))


def backward_recomputed_span(
    outputs: SpanOutputs,
    state,
    cotangent,
    *,
    rows: slice,
    end_checkpoint: int,
    what: str,
    remedy: str,
    extra: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> None:
    """Check `outputs` against `state` and backpropagate them with `cotangent` (steps 2-3).

    `state` holds the stored span (per-token arrays at `rows`, checkpoints at entry
    `end_checkpoint`; resident or tiered), `cotangent` its fp32 cotangents: per-token arrays
    shaped like the state's, and for checkpoint arrays the cotangent of the span's end [L, ...].
    `extra`: (output, its cotangent) pairs backpropagated with them. Run the backward inside
    whatever the recomputation needs to be entered again (attention functions, routing).
    """
    tensors = [output for output, _ in extra]
    grads = [grad.to(output.dtype) for output, grad in extra]
    for array, slot, recomputed in outputs.entries:
        held = getattr(state, array.field)
        if array.per_token:
            stored = stored_slice(held, slot, rows.start, rows.stop)
        else:
            stored = held[slot, end_checkpoint]
        require_equal(
            f"{what}: recomputed {array.field} of state slot {slot}", recomputed, stored, remedy
        )
        if not (array.has_cotangent and recomputed.requires_grad):
            continue
        held_cot = getattr(cotangent, array.field)
        if array.per_token:
            cot = stored_slice(held_cot, slot, rows.start, rows.stop)
        else:
            cot = held_cot[slot]
        tensors.append(recomputed)
        grads.append(cot.to(recomputed.dtype))
    if tensors:
        torch.autograd.backward(tensors, grads)


def take_start_cotangent(leaves: dict[int, tuple[torch.Tensor, torch.Tensor]], cotangent) -> None:
    """The span's start checkpoint (leaves by slot: conv tail, recurrent state) is read by
    nothing else: its gradient replaces the end's cotangent (zero where none flowed)."""
    for slot, (conv_leaf, recurrent_leaf) in leaves.items():
        cotangent.conv[slot] = 0.0 if conv_leaf.grad is None else conv_leaf.grad.float()
        cotangent.recurrent[slot] = (
            0.0 if recurrent_leaf.grad is None else recurrent_leaf.grad.float()
        )
