"""The sweep's layer recompute takes the delta rule's outputs from the layer's first forward.

Activation checkpointing recomputes every decoder layer in backward only to rebuild what its
backward saves; the blockwise delta rule saves its inputs, so running its kernel again there
would compute outputs already known. Checked: with the outputs kept, transformers' kernel runs
once per Gated DeltaNet layer and shard (not twice), and every gradient and the prompt
cotangent are bitwise those of the sweep that recomputes the kernel.

Legend: the tiny hybrids, a 150-token prompt in shards of 64 (3 shards), random cotangents.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from engine_helpers import random_ids, take_grads, vocab_of, zero_grads

from longstraw.engine import sweep
from longstraw.engine.prefill import prefill
from longstraw.engine.replay import PromptCotangent
from longstraw.models.adapters import decoder_of

PROMPT_LEN = 150
SHARD_TOKENS = 64


def _sweep(model, state) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """(parameter gradients, prompt cotangent after the sweep, kernel calls in backward)."""
    cotangent = PromptCotangent.zeros_like_state(state)
    generator = torch.Generator().manual_seed(42)
    for t in cotangent.__dict__.values():
        if isinstance(t, torch.Tensor):
            t.copy_(torch.randn(t.shape, generator=generator, dtype=t.dtype))
    layer = next(m for m in decoder_of(model).layers if hasattr(m, "linear_attn"))
    module = sys.modules[type(layer.linear_attn).__module__]
    kernel = module.torch_chunk_gated_delta_rule
    calls_in_backward = [0]

    def counted(*args, **kwargs):
        calls_in_backward[0] += sweep._in_shard_backward()
        return kernel(*args, **kwargs)

    module.torch_chunk_gated_delta_rule = counted
    try:
        zero_grads(model)
        sweep.sweep_prompt_shards(model, state, cotangent)
    finally:
        module.torch_chunk_gated_delta_rule = kernel
    kept = {k: v.clone() for k, v in cotangent.__dict__.items() if isinstance(v, torch.Tensor)}
    return take_grads(model), kept, calls_in_backward[0]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_sweep_with_kept_kernel_outputs_gives_the_recomputing_sweeps_bits(
    tiny_model, family, monkeypatch
):
    model = tiny_model(family)
    state = prefill(model, random_ids(PROMPT_LEN, vocab_of(model)), shard_tokens=SHARD_TOKENS)
    grads, cotangent, calls = _sweep(model, state)
    assert calls == 0, f"the delta-rule kernel ran {calls} times in the layers' recompute"

    # The reference: the same sweep whose layer recompute runs the kernel again.
    monkeypatch.setattr(sweep, "kernel_outputs_kept", lambda in_recompute: contextlib.nullcontext())
    expected_grads, expected_cotangent, expected_calls = _sweep(model, state)
    linear_layers = sum(hasattr(m, "linear_attn") for m in decoder_of(model).layers)
    assert expected_calls == linear_layers * state.num_shards
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, expected_grads[name]), name
    for name, value in cotangent.items():
        assert torch.equal(value, expected_cotangent[name]), name
