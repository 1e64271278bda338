"""Outputs of a checkpointed layer's first forward, kept for its recompute in backward.

The reverse sweep checkpoints every decoder layer of a shard: backward recomputes the layer
from its saved input only to rebuild what the layer's backward saves. The delta rule's and the
prefix attention's functions save their inputs (and, for attention, the output and its
log-sum-exp) and recompute what else they need in their own backward, so computing their
forward again in that recompute gives outputs already known, bit for bit: the same function on
the same inputs. Inside `first_pass_outputs_kept`, they keep those outputs by layer the first
time and hand them back while the recompute runs. The kept tensors share storage with the first
forward's outputs, from the first forward to the layer's recompute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator

import torch


class FirstPassOutputs:
    """Each site's outputs of its first forward, until the recompute takes them."""

    def __init__(self, in_recompute: Callable[[], bool]):
        self.in_recompute = in_recompute
        """True while a checkpointed layer is recomputed (a shard's backward)."""
        self.kept: dict[Hashable, tuple[torch.Tensor | None, ...]] = {}

    def kept_or_computed(
        self, key: Hashable, compute: Callable[[], tuple[torch.Tensor | None, ...]]
    ) -> tuple[torch.Tensor | None, ...]:
        """`compute()`, kept under `key`; in the recompute, what was kept under `key`."""
        if self.in_recompute():
            kept = self.kept.pop(key, None)
            return compute() if kept is None else kept
        outputs = compute()
        # Aliases without autograd history: the recompute's node takes them as its outputs.
        self.kept[key] = tuple(None if t is None else t.detach() for t in outputs)
        return outputs


_ACTIVE: list[FirstPassOutputs | None] = [None]


def active() -> FirstPassOutputs | None:
    """The outputs being kept (None outside `first_pass_outputs_kept`)."""
    return _ACTIVE[0]


@contextlib.contextmanager
def first_pass_outputs_kept(in_recompute: Callable[[], bool]) -> Iterator[FirstPassOutputs]:
    """Inside the block, the delta rule and the prefix attention keep their first forward's
    outputs per layer and return them while `in_recompute()`."""
    previous = _ACTIVE[0]
    _ACTIVE[0] = FirstPassOutputs(in_recompute)
    try:
        yield _ACTIVE[0]
    finally:
        _ACTIVE[0] = previous
