"""What the exact sweep keeps for backward while it recomputes a prefill shard.

The sweep's extra memory over detached mode is one shard's graph; inside it, the MLPs
and the gated delta rule keep only their inputs and rebuild their graph block by block in
backward (`longstraw.ops.blockwise_backward`). Checked structurally with `saved_tensors_hooks`,
on a one-shard prompt ten times the block: no MLP activation and no chunk-major delta-rule
tensor spanning more than one block is saved (the layer-level checkpoint is switched off for
the check: its own saved-tensor hooks would hide the tensors saved inside a layer).
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from engine_helpers import random_ids, vocab_of

from longstraw.engine import sweep
from longstraw.engine.prefill import prefill
from longstraw.engine.replay import PromptCotangent
from longstraw.models.adapters import decoder_of

BLOCK = 64
PROMPT_LEN = 641  # one shard of 640 tokens = 10 blocks


def _saved_shapes_during_sweep(model) -> list[tuple[int, ...]]:
    prompt = random_ids(PROMPT_LEN, vocab_of(model))
    state = prefill(model, prompt, shard_tokens=PROMPT_LEN)
    cotangent = PromptCotangent.zeros_like_state(state)
    for t in cotangent.__dict__.values():
        if isinstance(t, torch.Tensor):
            t.normal_()
    shapes: list[tuple[int, ...]] = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sweep.sweep_prompt_shards(model, state, cotangent)
    return shapes


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "llama"])
def test_sweep_saves_mlp_and_delta_rule_activations_one_block_at_a_time(
    tiny_model, family, monkeypatch
):
    monkeypatch.setattr(sweep, "SWEEP_BLOCK_TOKENS", BLOCK)
    # MLP blocks of BLOCK tokens too (the sweep's are a multiple of the delta rule's).
    monkeypatch.setattr(sweep, "MLP_BLOCKS_PER_DELTA_RULE_BLOCK", 1)
    # Without the layer-level checkpoint, whose own saved-tensor hooks would hide every tensor
    # saved inside a layer from ours: what remains saved is what the blockwise functions keep.
    monkeypatch.setattr(sweep, "layerwise_recompute", lambda model: contextlib.nullcontext())
    model = tiny_model(family)
    config = model.config.get_text_config()
    shapes = _saved_shapes_during_sweep(model)
    assert shapes, "the sweep saved nothing for backward: did it run?"
    # Dense MLPs (every layer of llama / qwen3_5, layer 0 of qwen3_next) are wider than hidden.
    assert config.intermediate_size != config.hidden_size
    wide = config.intermediate_size
    mlp_wide = [s for s in shapes if len(s) == 3 and s[1] > BLOCK and s[2] == wide]
    assert not mlp_wide, f"MLP activations saved for more than {BLOCK} tokens: {mlp_wide[:5]}"
    # The chunked delta rules (transformers' and LongStraw's) work on [B, H, N, C, D] tensors.
    chunk_major = [s for s in shapes if len(s) == 5 and s[2] * s[3] > BLOCK]
    assert not chunk_major, f"delta-rule chunk tensors over more than one block: {chunk_major[:5]}"


def test_sweep_restores_the_model_and_transformers_after_it_ran(tiny_model):
    model = tiny_model("qwen3_5")
    layers = list(decoder_of(model).layers)
    modeling = sys.modules[type(layers[0].linear_attn).__module__]
    delta_rule = modeling.torch_chunk_gated_delta_rule
    _saved_shapes_during_sweep(model)
    assert modeling.torch_chunk_gated_delta_rule is delta_rule
    for layer in layers:
        assert "forward" not in vars(layer) and "forward" not in vars(layer.mlp)
