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
within-chunk segment sums (`longstraw.ops.gated_delta_rule`). Without grad the original is called as it is.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from transformers import PreTrainedModel

from longstraw.models.adapters import decoder_of
from longstraw.ops.blockwise_backward import gated_delta_rule_recomputed_in_blocks

_GDN_FUNCTION = "torch_chunk_gated_delta_rule"
# Set on the installed functions, so that a nested block does not wrap them twice.
_MARK = "longstraw_blockwise"


@contextlib.contextmanager
def delta_rule_backward_recomputed(
    model: PreTrainedModel, block_tokens: Callable[[], int]
) -> Iterator[None]:
    """Inside the block, `model`'s chunked delta rule runs through
    `gated_delta_rule_recomputed_in_blocks` with `block_tokens()` tokens per block (read at
    each call). A block entered while another is active changes nothing."""
    modules = {
        sys.modules[type(layer.linear_attn).__module__]
        for layer in decoder_of(model).layers
        if hasattr(layer, "linear_attn")
    }
    undo = []
    for module in modules:
        original = getattr(module, _GDN_FUNCTION, None)
        if original is None or getattr(original, _MARK, False):
            continue

        def blockwise(*args, _original=original, **kwargs):
            return gated_delta_rule_recomputed_in_blocks(
                _original, *args, block_tokens=block_tokens(), **kwargs
            )

        setattr(blockwise, _MARK, True)
        setattr(module, _GDN_FUNCTION, blockwise)
        undo.append((module, original))
    try:
        yield
    finally:
        for module, original in reversed(undo):
            setattr(module, _GDN_FUNCTION, original)
