"""Where a group's parameter gradients go: taken from `.grad` the moment autograd accumulates
each one, added into an fp32 accumulator, `.grad` dropped.

A backward therefore never holds a second full copy of the gradients beside the accumulator (for
a bf16 model of 27 B parameters, the 54 GB of `.grad` that draining after the backward would
keep). One process accumulates the whole gradient (`whole_gradient`, a `GradBuffer`); a rank of a
sequence group its rows of it (`longstraw.distributed.gradient_slices`). The placement's
`PrefixExchange.gradient_sink` picks one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from longstraw.grpo.grad_buffer import GradBuffer


def trainable_parameters(model: PreTrainedModel) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def drain_grads_into(params: list[tuple[str, torch.nn.Parameter]], buffer: GradBuffer) -> None:
    for name, p in params:
        if p.grad is not None:
            buffer.grads[name] += p.grad.float()
            p.grad = None


@contextlib.contextmanager
def grads_consumed_by(
    params: list[tuple[str, torch.nn.Parameter]],
    consume: Callable[[int, str, torch.Tensor], None],
) -> Iterator[None]:
    """Inside the block, each parameter's gradient is handed to `consume(index in params, name,
    grad)` the moment autograd has accumulated it, and `.grad` is dropped: a backward never holds
    a second full copy of the gradients beside the accumulator, only the parameter being
    accumulated (for a bf16 model of 27 B parameters, the 54 GB of `.grad` that draining after
    the backward would keep).
    """

    def hook(p: torch.nn.Parameter, index: int, name: str) -> None:
        consume(index, name, p.grad)
        p.grad = None

    handles = [
        p.register_post_accumulate_grad_hook(functools.partial(hook, index=i, name=name))
        for i, (name, p) in enumerate(params)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def grads_drained_into(
    params: list[tuple[str, torch.nn.Parameter]], buffer: GradBuffer
) -> contextlib.AbstractContextManager[None]:
    """Inside the block, each parameter's gradient is added to the fp32 `buffer` as soon as
    autograd has accumulated it (`grads_consumed_by`)."""

    def add(index: int, name: str, grad: torch.Tensor) -> None:
        buffer.grads[name] += grad.float()

    return grads_consumed_by(params, add)


@contextlib.contextmanager
def grads_set_aside(params: list[tuple[str, torch.nn.Parameter]]) -> Iterator[None]:
    """`.grad` of the parameters is None inside the block and restored after it: gradients
    accumulated before are set aside so that the block's contribution is measured alone, and
    the caller's `.grad` is left untouched."""
    stashed = {name: p.grad for name, p in params}
    for _, p in params:
        p.grad = None
    try:
        yield
    finally:
        for name, p in params:
            p.grad = stashed[name]


class HoldsGrads(Protocol):
    """A gradient accumulator: fp32 tensors by trainable parameter name."""

    grads: dict[str, torch.Tensor]


@dataclass
class GradientSink:
    """Where one group's parameter gradients accumulate (`PrefixExchange.gradient_sink`)."""

    accumulator: HoldsGrads
    """`.grads` by parameter name: the whole fp32 gradient (one process, a `GradBuffer`) or
    this rank's dim-0 rows of it (`longstraw.distributed.gradient_slices.GradSlices`)."""
    replay: contextlib.AbstractContextManager
    """Around branch replay: takes each parameter's gradient as autograd accumulates it."""
    sweep: contextlib.AbstractContextManager
    """Around the reverse sweep, likewise."""
    on_gradient_slices: Callable[[int, int], None] | None = None
    """The sweep's receiver of gradient rows another rank's shard produced (ranks)."""


def whole_gradient(model: PreTrainedModel) -> GradientSink:
    """One process: one fp32 buffer of the whole gradient, which replay and sweep both drain
    `.grad` into."""
    params, buffer = trainable_parameters(model), GradBuffer(model)
    return GradientSink(
        buffer,
        replay=grads_drained_into(params, buffer),
        sweep=grads_drained_into(params, buffer),
    )
