"""Shared turns once: a group's branches as a prefix tree, each shared span computed once.

Legend: branch position j (0-based, after the prompt) has input `[x_last] + y` at j and target
y_j; T prompt-state tokens; a node covers positions [s, e).

Branches whose responses agree on their first m tokens have the same inputs and targets at
positions 0 .. m-1, so the same state, logits and log-probs there. The tree's nodes are those
shared spans (a radix tree over the responses); each node's span is run once:

- forward (no autograd, in segments of `segment_tokens`) on top of the prompt state and the
  node's ancestors, into the node's branch state (`segmented_replay`), which holds positions
  [0, e): the ancestors' part copied from the parent (branch-sized, never prompt-sized);
- depth first, one child subtree at a time: a response's loss is computed as soon as its path
  has run (its log-probs are the concatenation along the path), and its dL/dlog p is added to
  the nodes of its path;
- after all its children, the node's segments are backpropagated last to first
  (`segmented_replay._segment_backward`) with the summed cotangents: of its log-probs (over
  every response below it), of its own K/V (what its children's attention added), of its end
  state (the sum of its children's start-state cotangents). What reaches the ancestors'
  positions is added into the parent's cotangent; what reaches the node's start state goes to
  the parent's end state, or, for a top node, to the prompt's final state (exact mode).

Every sum here is a sum over branches of terms that separate replay would compute one branch at
a time, so log-probs and gradients equal computing each branch separately (tests compare them).
Memory: the states of one root-to-node path at a time, one segment's graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from longstraw.engine.exchange import LOCAL, PrefixExchange
from longstraw.engine.layer_kinds import COTANGENT_ARRAYS, TOKEN_ARRAYS
from longstraw.engine.replay import PromptCotangent, replay_logits, token_logprobs
from longstraw.engine.segmented_replay import (
    _segment_backward,
    _segment_cache,
    _writer,
    allocate_branch_state,
    segment_bounds,
)
from longstraw.engine.state import PrefixState

TreeLossFn = Callable[[int, torch.Tensor], tuple[torch.Tensor, object]]
LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, object]]


@dataclass
class TreeNode:
    """A span of branch positions [start, end) that every response below it shares."""

    start: int
    end: int
    tokens: list[int]
    """[end] the targets y_0 .. y_{end-1} (the same for every response below)."""
    responses: list[int] = field(default_factory=list)
    """Indices of the responses that end here (their last position is end - 1)."""
    children: list[TreeNode] = field(default_factory=list)


def build_prefix_tree(responses: Sequence[Sequence[int]]) -> list[TreeNode]:
    """The top nodes of the radix tree over `responses` (each response's path ends at a node)."""

    def build(indices: list[int], start: int) -> TreeNode:
        rows = [list(responses[i]) for i in indices]
        end = min(len(r) for r in rows)
        for j in range(start, end):
            if any(r[j] != rows[0][j] for r in rows[1:]):
                end = j
                break
        node = TreeNode(start, end, rows[0][:end])
        node.responses = [i for i, r in zip(indices, rows, strict=True) if len(r) == end]
        node.children = _children([i for i in indices if len(responses[i]) > end], end)
        return node

    def _children(indices: list[int], start: int) -> list[TreeNode]:
        groups: dict[int, list[int]] = {}
        for i in indices:
            groups.setdefault(int(responses[i][start]), []).append(i)
        return [build(group, start) for group in groups.values()]

    return _children(list(range(len(responses))), 0)


def _node_bounds(node: TreeNode, segment_tokens: int | None) -> tuple[tuple[int, int], ...]:
    """The node state's bounds: the ancestors' positions as one (never recomputed), then the
    node's own span in segments."""
    span = node.end - node.start
    own = segment_bounds(span, segment_tokens if segment_tokens is not None else span)
    own = tuple((node.start + a, node.start + b) for a, b in own)
    return (((0, node.start),) if node.start > 0 else ()) + own


@dataclass
class _Path:
    """What the parent hands a child: its state and log-probs over [0, parent end)."""

    state: PrefixState | None
    logp: torch.Tensor
    """[parent end] fp32 log-probs of the parent path's targets."""
    cotangent: PromptCotangent | None = None
    """The parent state's fp32 cotangent, which children add their ancestors' part into."""
    grad_logp: torch.Tensor | None = None
    """[parent end] dL/dlog p summed over the responses below, which children add into."""


@dataclass(frozen=True)
class _TreeRun:
    """What every node of one `tree_group_backward` call shares."""

    model: PreTrainedModel
    prompt: PrefixState
    loss_fn: TreeLossFn
    segment_tokens: int | None
    temperature: float
    cotangent: PromptCotangent | None
    exchange: PrefixExchange


def tree_group_backward(
    model: PreTrainedModel,
    prompt: PrefixState,
    responses: Sequence[torch.Tensor],
    loss_fn: TreeLossFn,
    *,
    segment_tokens: int | None,
    temperature: float = 1.0,
    cotangent: PromptCotangent | None = None,
    exchange: PrefixExchange = LOCAL,
) -> list[tuple[torch.Tensor, torch.Tensor, object]]:
    """Backpropagate `loss_fn(i, logp_i)` of every response i through a prefix tree.

    Returns, per response, (log-probs [R_i] detached, loss (0-d detached), stats). Parameter
    gradients accumulate as with `loss.backward()`; with `cotangent` (exact mode) the prompt
    state's cotangent is added into it. `segment_tokens` None: each node's span is one graph.
    `exchange`: how the prompt's prefix is read (`engine.exchange`; a sharded prompt's ranks
    all run this with the same arguments).
    """
    ids = [torch.as_tensor(r, dtype=torch.long).cpu() for r in responses]
    results: list = [None] * len(ids)
    empty = _Path(None, torch.zeros(0, dtype=torch.float32, device=model.device))
    run = _TreeRun(model, prompt, loss_fn, segment_tokens, temperature, cotangent, exchange)
    for node in build_prefix_tree([r.tolist() for r in ids]):
        bcot_start = _run_node(run, node, empty, results)
        if cotangent is not None and bcot_start is not None:
            # A top node starts from the prompt's final state, which every branch reads.
            cotangent.conv += bcot_start[0]
            cotangent.recurrent += bcot_start[1]
    return results


def _run_node(run: _TreeRun, node: TreeNode, parent: _Path, results: list):
    """Forward the node, run its subtree, backpropagate it. Returns the cotangent of its start
    linear-attention state ((conv, recurrent) [L, ...], or None without linear layers) after
    adding its ancestors' K/V cotangent into `parent.cotangent`."""
    model, prompt, temperature = run.model, run.prompt, run.temperature
    bounds = _node_bounds(node, run.segment_tokens)
    targets = torch.tensor(node.tokens, dtype=torch.long, device=model.device)
    inputs = torch.cat([torch.tensor([prompt.last_token_id], device=model.device), targets[:-1]])
    state = allocate_branch_state(prompt, inputs, bounds)
    first_own = 1 if node.start > 0 else 0
    if node.start > 0:
        _copy_ancestors(parent.state, state, node.start)
    logps = [parent.logp]
    with torch.no_grad():
        for k in range(first_own, len(bounds)):
            a, b = bounds[k]
            cache, _ = _segment_cache(
                prompt,
                state,
                k,
                prompt_cotangent=None,
                branch_cotangent=None,
                on_update=_writer(state, k),
                exchange=run.exchange,
            )
            logits = replay_logits(model, prompt, inputs[a:b].unsqueeze(0), cache, run.exchange)
            logps.append(token_logprobs(logits, targets[a:b].unsqueeze(0), temperature)[0])
            del logits, cache
    logp = torch.cat(logps)
    grad_logp = torch.zeros_like(logp)
    bcot = PromptCotangent.zeros_like_state(state)
    here = _Path(state, logp, bcot, grad_logp)

    # Children first: their losses and backward fill this node's cotangents.
    for child in node.children:
        start_cot = _run_node(run, child, here, results)
        if start_cot is not None:
            bcot.conv += start_cot[0]
            bcot.recurrent += start_cot[1]
    for i in node.responses:
        leaf = logp.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            loss, stats = run.loss_fn(i, leaf)
            loss.backward()
        if leaf.grad is not None:
            grad_logp += leaf.grad
        results[i] = (leaf.detach(), loss.detach(), stats)

    for k in reversed(range(first_own, len(bounds))):
        _segment_backward(
            model, prompt, state, k, targets, inputs, grad_logp, logp, temperature,
            run.cotangent, bcot, run.exchange,
        )  # fmt: skip
    if node.start > 0:
        _add_ancestor_cotangent(bcot, parent.cotangent, node.start)
        parent.grad_logp[: node.start] += grad_logp[: node.start]
    if bcot.conv is None:
        return None
    return bcot.conv, bcot.recurrent


def _copy_ancestors(parent: PrefixState, child: PrefixState, end: int) -> None:
    """Positions [0, end) of the parent's state into the child's, and the parent's end state as
    the state at the start of the child's own span (entry 1: after the ancestors' bound)."""
    for array in TOKEN_ARRAYS:
        src = getattr(parent, array.field)
        if src is not None:
            getattr(child, array.field)[:, :end] = src[:, :end]
    if parent.conv is not None:
        child.conv[:, 1] = parent.conv[:, parent.num_shards]
        child.recurrent[:, 1] = parent.recurrent[:, parent.num_shards]


def _add_ancestor_cotangent(child: PromptCotangent, parent: PromptCotangent, end: int) -> None:
    for array in COTANGENT_ARRAYS:
        src = getattr(child, array.field) if array.per_token else None
        if src is not None:
            getattr(parent, array.field)[:, :end] += src[:, :end]


def segmented_branch_backward(
    model: PreTrainedModel,
    prompt: PrefixState,
    response_ids: torch.Tensor,
    loss_fn: LossFn,
    *,
    segment_tokens: int,
    temperature: float = 1.0,
    cotangent: PromptCotangent | None = None,
    exchange: PrefixExchange = LOCAL,
) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Replay one branch in segments and backpropagate `loss_fn(logp [R])` through it.

    Returns (log-probs [R] detached, the loss (0-d, detached), the loss's stats). Parameter
    gradients accumulate as in `loss.backward()`; with `cotangent` (exact mode) the cotangent
    of the prompt state the branch read is added into it, including its final linear-attention
    state (what `BranchCache.add_leaf_grads_into` does for a whole-branch replay). A prefix
    tree of one branch (`longstraw.engine.branch_tree`).
    """
    (result,) = tree_group_backward(
        model,
        prompt,
        [response_ids],
        lambda i, logp: loss_fn(logp),
        segment_tokens=segment_tokens,
        temperature=temperature,
        cotangent=cotangent,
        exchange=exchange,
    )
    return result
