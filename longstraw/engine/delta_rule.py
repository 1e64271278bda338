"""The gated delta rule the model's Gated DeltaNet layers call while LongStraw differentiates them.

transformers' Gated DeltaNet (qwen3_5, qwen3_next) calls the module-level
`torch_chunk_gated_delta_rule` of its modeling module (fla's kernel when installed). Its forward
is kept everywhere — prefill, replay and sweep then compute the same bits, which the sweep's
bitwise state check relies on — but its backward is not used: autograd through transformers'
pure-torch kernel forms the decay gradients (A_log, dt_bias) from differences of one cumsum of
the log-decays and loses up to 4 digits on them against the fp32 recurrence (docs/engine.md,
"Precision against float64").

Inside `delta_rule_backward_recomputed`, the name is bound to
`gated_delta_rule_recomputed_in_blocks`: the same forward under no_grad, and a backward that
recomputes block by block on LongStraw's chunked kernel, in float64, whose decays are exp of
within-chunk segment sums (`longstraw.ops.gated_delta_rule`). Without grad the original is
called as it is.

The layer forms its log-decays `g = -exp(A_log) * softplus(a + dt_bias)` in fp32 before the
call, and autograd would sum their fp32 gradients over every token into dA_log and ddt_bias,
which cancel 100-1000-fold. So the block also records, per Gated DeltaNet layer, the `a` it
projects (a forward hook on qwen3_5's `in_proj_a`; the last output of qwen3_next's
`fix_query_key_value_ordering`), and hands the kernel the `DecayGate(a, A_log, dt_bias)`
instead of `g` (`longstraw.ops.decay_gate`): its forward runs on the same fp32 `g`, bit for bit
(checked at each call, `g` itself is passed where it differs), and its backward forms and
differentiates the log-decays in float64.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from longstraw.engine import first_pass
from longstraw.models.adapters import decoder_of
from longstraw.ops.blockwise_backward import gated_delta_rule_recomputed_in_blocks
from longstraw.ops.decay_gate import DecayGate

_GDN_FUNCTION = "torch_chunk_gated_delta_rule"
# qwen3_next splits `a` out of one projection here; qwen3_5 projects it with `in_proj_a`.
_QWEN3_NEXT_SPLIT = "fix_query_key_value_ordering"
# Set on the installed functions and on hooked layers, so that a nested block does not wrap
# them twice.
_MARK = "longstraw_blockwise"


class _GateCapture:
    """The Gated DeltaNet layer whose forward is running, and the `a` [B, T, Hv] it projected.
    Set by the layer's hooks, read by the installed kernel; one per process, since a layer's
    forward runs to its end before another starts."""

    layer: nn.Module | None = None
    a: torch.Tensor | None = None

    def gate_for(self, g: torch.Tensor) -> torch.Tensor | DecayGate:
        """The running layer's `DecayGate` when it forms `g` bit for bit, else `g` (and `g`
        without grad, where the kernel's backward never runs)."""
        if not torch.is_grad_enabled() or self.layer is None or self.a is None:
            return g
        gate = DecayGate(self.a, self.layer.A_log, self.layer.dt_bias)
        if gate.shape != g.shape or not torch.equal(gate.fp32(), g):
            return g
        return gate


_CAPTURE = _GateCapture()


def _kept_or_computed(kept: first_pass.FirstPassOutputs, layer: nn.Module, kernel, *args, **kw):
    """The kernel's (output, final state) for `layer`, kept from its first forward for the
    layer's recompute in backward (`engine.first_pass`)."""
    return kept.kept_or_computed(layer, lambda: kernel(*args, **kw))


def _enter_layer(layer: nn.Module, args) -> None:
    _CAPTURE.layer, _CAPTURE.a = layer, None


def _leave_layer(layer: nn.Module, args, output) -> None:
    _CAPTURE.layer, _CAPTURE.a = None, None


def _record_a(projection: nn.Module, args, a: torch.Tensor) -> None:
    _CAPTURE.a = a


def _hook_gate_inputs(layer: nn.Module) -> Callable[[], None]:
    """Hooks that record `layer`'s decay-gate input `a` while it runs; returns their undo."""
    handles = [
        layer.register_forward_pre_hook(_enter_layer),
        layer.register_forward_hook(_leave_layer),
    ]
    undo_split = None
    if hasattr(layer, "in_proj_a"):
        handles.append(layer.in_proj_a.register_forward_hook(_record_a))
    elif hasattr(layer, _QWEN3_NEXT_SPLIT):
        split = getattr(layer, _QWEN3_NEXT_SPLIT)

        def split_and_record(*args, **kwargs):
            parts = split(*args, **kwargs)
            _CAPTURE.a = parts[-1]
            return parts

        setattr(layer, _QWEN3_NEXT_SPLIT, split_and_record)

        def undo_split():
            delattr(layer, _QWEN3_NEXT_SPLIT)

    setattr(layer, _MARK, True)

    def undo():
        for handle in handles:
            handle.remove()
        if undo_split is not None:
            undo_split()
        delattr(layer, _MARK)

    return undo


@contextlib.contextmanager
def delta_rule_backward_recomputed(
    model: PreTrainedModel, block_tokens: Callable[[], int]
) -> Iterator[None]:
    """Inside the block, `model`'s chunked delta rule runs through
    `gated_delta_rule_recomputed_in_blocks` with `block_tokens()` tokens per block (read at
    each call), given each layer's decay gate. A block entered while another is active changes
    nothing."""
    layers = [
        layer.linear_attn for layer in decoder_of(model).layers if hasattr(layer, "linear_attn")
    ]
    undo = []
    for module in {sys.modules[type(layer).__module__] for layer in layers}:
        original = getattr(module, _GDN_FUNCTION, None)
        if original is None or getattr(original, _MARK, False):
            continue

        def blockwise(*args, _original=original, **kwargs):
            # transformers passes q, k, v by position and g by name.
            if "g" in kwargs:
                kwargs["g"] = _CAPTURE.gate_for(kwargs["g"])
            else:
                args = (*args[:3], _CAPTURE.gate_for(args[3]), *args[4:])
            kernel = _original
            kept = first_pass.active()
            if kept is not None and _CAPTURE.layer is not None:
                kernel = functools.partial(_kept_or_computed, kept, _CAPTURE.layer, _original)
            return gated_delta_rule_recomputed_in_blocks(
                kernel, *args, block_tokens=block_tokens(), **kwargs
            )

        setattr(blockwise, _MARK, True)
        setattr(module, _GDN_FUNCTION, blockwise)
        undo.append(
            lambda module=module, original=original: setattr(module, _GDN_FUNCTION, original)
        )
    for layer in layers:
        if not getattr(layer, _MARK, False):
            undo.append(_hook_gate_inputs(layer))
    try:
        yield
    finally:
        for step in reversed(undo):
            step()
