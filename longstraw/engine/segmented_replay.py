"""Branches of any length: replay a long branch segment by segment, one segment's graph at a time.

Legend: T = P - 1 prompt-state tokens, R branch tokens (input `[x_last] + y[:-1]`), segments
[a, b) of at most `segment_tokens` branch positions, L layers of one kind.

A branch longer than `segment_tokens` is not one autograd graph. Instead:

1. **Forward, no autograd.** Segment by segment, run the branch at positions T + a .. T + b - 1
   on top of the prompt state, reading the branch's own earlier segments, and write this
   segment's K/V (MLA latents, Gated DeltaNet state at its end) into a *branch state* — a
   `PrefixState` of the sequence `[x_last] + y`, exactly as prefill fills the prompt's. Keep
   each segment's log-probs.
2. **The loss** of the whole branch is computed on those log-probs as a leaf: its gradient
   dL/dlogp [R] is all the segments need, whatever the loss type (sequence-level terms too).
3. **Reverse, one segment at a time.** For segment k = last .. first: recompute it with
   autograd from the stored state before it (checked bitwise against what step 1 stored),
   and backpropagate its log-probs with dL/dlogp, its own K/V / latents with their cotangent
   (complete by now: only later segments read them) and its end recurrent state with the
   cotangent the next segment handed back. The attention adds the cotangent of earlier branch
   positions into a fp32 *branch cotangent* and, in exact mode, of prompt positions into the
   prompt's `PromptCotangent`; the Gated DeltaNet start state is a leaf whose gradient becomes
   the previous segment's end-state cotangent, and for the first segment that of the prompt's
   final state.

This is reverse-mode autodiff of the branch with its own stored state as the checkpoint of each
segment's inputs: the same chain rule as autograd over the whole branch. Memory: the prompt
state (+ its cotangent in exact mode), the branch state + its fp32 cotangent, one segment's
graph — flat in the branch length apart from the branch's own per-token state. Detached mode
keeps its meaning (no cotangent reaches the prompt); the branch's earlier segments are exact in
both modes. Compute: one extra forward of the branch.
"""

from __future__ import annotations

import torch

from longstraw.engine.cache import StateCache
from longstraw.engine.exchange import LOCAL, PrefixExchange
from longstraw.engine.layer_kinds import Record, segment_layers, state_writer
from longstraw.engine.recomputed_span import (
    SpanOutputs,
    backward_recomputed_span,
    require_equal,
    take_start_cotangent,
)
from longstraw.engine.replay import PromptCotangent, replay_logits, token_logprobs
from longstraw.engine.state import PrefixState


def segment_bounds(num_tokens: int, segment_tokens: int) -> tuple[tuple[int, int], ...]:
    """[a, b) of each segment over `num_tokens` branch positions; the last may be shorter."""
    if segment_tokens < 1:
        raise ValueError(f"branch_segment_tokens must be >= 1 (or None), got {segment_tokens}")
    return tuple(
        (a, min(a + segment_tokens, num_tokens)) for a in range(0, num_tokens, segment_tokens)
    )


def allocate_branch_state(
    prompt: PrefixState, input_ids: torch.Tensor, bounds: tuple[tuple[int, int], ...]
) -> PrefixState:
    """The state of branch positions [0, R) (R = len(input_ids)): a `PrefixState` of
    `input_ids + [0]` whose "shards" are `bounds`; linear-attention entry k is the state at the
    start of bound k, entry 0 the prompt's final state (the branch starts from it)."""
    ids = torch.cat([input_ids.cpu(), torch.zeros(1, dtype=torch.long)])
    # The state's first array (a whole state's or a rank's slice) gives its dtype and device.
    like = next(t for t in (prompt.keys, prompt.conv, prompt.latent) if t is not None)
    branch = PrefixState.allocate(
        prompt.spec,
        prompt_ids=ids,
        shard_tokens=max(1, ids.numel()),
        dtype=like.dtype,
        device=like.device,
    )
    branch.bounds = tuple(bounds)
    if branch.conv is not None:
        shape = (branch.conv.shape[0], len(bounds) + 1)
        branch.conv = branch.conv.new_zeros(*shape, *branch.conv.shape[2:])
        branch.recurrent = branch.recurrent.new_zeros(*shape, *branch.recurrent.shape[2:])
        # The prompt's final linear-attention state: every rank of a sharded prompt keeps it.
        branch.conv[:, 0], branch.recurrent[:, 0] = prompt.final_linear_state_all()
    return branch


def _segment_cache(
    prompt: PrefixState,
    branch: PrefixState,
    k: int,
    *,
    prompt_cotangent: PromptCotangent | None,
    branch_cotangent: PromptCotangent | None,
    on_update: Record,
    exchange: PrefixExchange = LOCAL,
) -> tuple[StateCache, dict[str, dict[int, tuple[torch.Tensor, ...]]]]:
    """The cache of segment k and, with autograd (`branch_cotangent` given), its leaves by
    kind (`LayerKind.segment_layer`): {"linear_attention": {slot: (conv, recurrent)} at the
    segment start, "mla": {slot: (latent, rope)} of the earlier branch positions}."""
    a, _ = branch.bounds[k]
    leaves: dict = {}
    layers = segment_layers(
        prompt,
        branch,
        k,
        prompt_cotangent=prompt_cotangent,
        branch_cotangent=branch_cotangent,
        leaves=leaves,
        on_update=on_update,
        kind_kwargs=exchange.layers.segment_kwargs(prompt),
    )
    return StateCache(layers, position_offset=prompt.num_tokens + a), leaves


def _writer(branch: PrefixState, k: int) -> Record:
    """Stores segment k's new state into the branch state (no autograd)."""
    a, b = branch.bounds[k]
    return state_writer(branch, slice(a, b), k + 1)


# A mismatch between a segment's two forwards: a kernel that is not deterministic.
_SEGMENT_REMEDY = "run with deterministic kernels"


def _segment_backward(
    model,
    prompt,
    branch,
    k,
    response,
    input_ids,
    grad_logp,
    logp,
    temperature,
    cotangent,
    bcot,
    exchange: PrefixExchange = LOCAL,
) -> None:
    """Recompute segment k with autograd, check it, backpropagate its outputs' cotangents."""
    a, b = branch.bounds[k]
    outputs = SpanOutputs()
    with torch.enable_grad():
        cache, leaves = _segment_cache(
            prompt,
            branch,
            k,
            prompt_cotangent=cotangent,
            branch_cotangent=bcot,
            on_update=outputs,
            exchange=exchange,
        )
        logits = replay_logits(model, prompt, input_ids[a:b].unsqueeze(0), cache, exchange)
        logp_seg = token_logprobs(logits, response[a:b].unsqueeze(0), temperature)[0]
        del logits
    require_equal(f"branch segment {k}: recomputed log-probs", logp_seg, logp[a:b], _SEGMENT_REMEDY)
    backward_recomputed_span(
        outputs,
        branch,
        bcot,
        rows=slice(a, b),
        end_checkpoint=k + 1,
        what=f"branch segment {k}",
        remedy=_SEGMENT_REMEDY,
        extra=[(logp_seg, grad_logp[a:b])],
    )
    for slot, (latent, rope) in leaves.get("mla", {}).items():
        if latent.grad is not None:
            bcot.latent[slot, :a] += latent.grad.float()
        if rope.grad is not None:
            bcot.rope_key[slot, :a] += rope.grad.float()
    # The start state of segment k is read by nothing else: its cotangent replaces the end's
    # (the caller hands that of the first segment on: parent node or prompt).
    take_start_cotangent(leaves.get("linear_attention", {}), bcot)
