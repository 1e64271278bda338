"""The sweep's layer recompute takes the delta rule's and the prefix attention's outputs from the
layer's first forward (`longstraw.engine.first_pass`).

Activation checkpointing recomputes every decoder layer in backward only to rebuild what its
backward saves; the blockwise delta rule saves its inputs and the prefix attention its inputs,
output and log-sum-exp, so running either forward again there would compute outputs already
known. Checked: with the outputs kept, transformers' delta-rule kernel and the prefix attention's
forward run once per layer and shard (not twice), and every gradient and the prompt cotangent
are bitwise those of the sweep that recomputes them.

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
from longstraw.ops import prefix_attention

PROMPT_LEN = 150
SHARD_TOKENS = 64


def _sweep(model, state, monkeypatch) -> tuple[dict, dict, int, int]:
    """(parameter gradients, prompt cotangent after the sweep, delta-rule kernel calls and
    prefix-attention forwards in backward)."""
    cotangent = PromptCotangent.zeros_like_state(state)
    generator = torch.Generator().manual_seed(42)
    for t in cotangent.__dict__.values():
        if isinstance(t, torch.Tensor):
            t.copy_(torch.randn(t.shape, generator=generator, dtype=t.dtype))
    calls = {"delta rule": 0, "attention": 0}

    def counting(name, function):
        def counted(*args, **kwargs):
            calls[name] += sweep._in_shard_backward()
            return function(*args, **kwargs)

        return counted

    linear = [m.linear_attn for m in decoder_of(model).layers if hasattr(m, "linear_attn")]
    if linear:
        module = sys.modules[type(linear[0]).__module__]
        kernel = module.torch_chunk_gated_delta_rule
        monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", counting("delta rule", kernel))
    forward = prefix_attention._attention_outputs
    monkeypatch.setattr(prefix_attention, "_attention_outputs", counting("attention", forward))
    zero_grads(model)
    sweep.sweep_prompt_shards(model, state, cotangent)
    monkeypatch.undo()
    kept = {k: v.clone() for k, v in cotangent.__dict__.items() if isinstance(v, torch.Tensor)}
    return take_grads(model), kept, calls["delta rule"], calls["attention"]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "llama"])
def test_sweep_with_kept_first_pass_outputs_gives_the_recomputing_sweeps_bits(
    tiny_model, family, monkeypatch
):
    model = tiny_model(family)
    state = prefill(model, random_ids(PROMPT_LEN, vocab_of(model)), shard_tokens=SHARD_TOKENS)
    grads, cotangent, delta_rule_calls, attention_calls = _sweep(model, state, monkeypatch)
    assert delta_rule_calls == 0, f"the delta rule ran {delta_rule_calls} times in the recompute"
    assert attention_calls == 0, f"the attention ran {attention_calls} times in the recompute"

    # The reference: the same sweep whose layer recompute runs both forwards again.
    with monkeypatch.context() as patch:
        patch.setattr(
            sweep, "first_pass_outputs_kept", lambda in_recompute: contextlib.nullcontext()
        )
        expected_grads, expected_cotangent, *expected_calls = _sweep(model, state, patch)
    layers = decoder_of(model).layers
    linear_layers = sum(hasattr(m, "linear_attn") for m in layers)
    assert expected_calls == [
        linear_layers * state.num_shards,
        (len(layers) - linear_layers) * state.num_shards,
    ]
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, expected_grads[name]), name
    for name, value in cotangent.items():
        assert torch.equal(value, expected_cotangent[name]), name
