"""The delta rule LongStraw installs while it differentiates: each Gated DeltaNet layer's kernel
gets the layer's decay gate (`DecayGate(a, A_log, dt_bias)`), whose fp32 log-decays are the
layer's own bit for bit, and the block leaves the model as it found it."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import HYBRID_FAMILIES, random_ids, vocab_of

import longstraw.engine.delta_rule as delta_rule
from longstraw.ops.decay_gate import DecayGate

TOKENS = 70
BLOCK_TOKENS = 24


def _gdn_layers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "A_log")]


def _decay_grads(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """d(sum of logits * fixed weights)/d(decay-gate parameters), {name: grad}."""
    for p in model.parameters():
        p.grad = None
    logits = model(input_ids=ids[None]).logits
    weights = torch.linspace(-1.0, 1.0, logits.numel()).reshape(logits.shape)
    (logits * weights).sum().backward()
    return {
        name: p.grad.clone()
        for name, p in model.named_parameters()
        if name.endswith(("A_log", "dt_bias", "in_proj_a.weight", "in_proj_ba.weight"))
    }


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_every_layer_gets_its_decay_gate(tiny_model, family, monkeypatch):
    model = tiny_model(family)
    ids = random_ids(TOKENS, vocab_of(model))
    with monkeypatch.context() as patch:
        patch.setattr(delta_rule._GateCapture, "gate_for", lambda self, g: g)
        with delta_rule.delta_rule_backward_recomputed(model, lambda: BLOCK_TOKENS):
            ungated = _decay_grads(model, ids)

    calls = []
    original = delta_rule.gated_delta_rule_recomputed_in_blocks

    def spy(forward_fn, *args, g, **kwargs):
        calls.append(g)
        return original(forward_fn, *args, g=g, **kwargs)

    monkeypatch.setattr(delta_rule, "gated_delta_rule_recomputed_in_blocks", spy)
    with delta_rule.delta_rule_backward_recomputed(model, lambda: BLOCK_TOKENS):
        gated = _decay_grads(model, ids)

    layers = _gdn_layers(model)
    assert len(calls) == len(layers) >= 2
    for g, layer in zip(calls, layers, strict=True):
        assert isinstance(g, DecayGate), type(g)
        assert g.A_log is layer.A_log and g.dt_bias is layer.dt_bias
        assert g.a.shape == (1, TOKENS, layer.num_v_heads)
    # The gradients of the same kernel given `g` itself, to the digits the fp32 rounding of the
    # decays' gradient leaves (test_float64_gradient.py says which is nearer the truth).
    assert ungated.keys() == gated.keys() and ungated
    for name, expected in ungated.items():
        rel = ((gated[name] - expected).norm() / expected.norm()).item()
        assert rel < 1e-5, (name, rel)


def test_a_gate_that_does_not_form_g_is_not_used(tiny_model):
    """A layer whose log-decays are not the gate's formula (a patched or future transformers)
    gets its own `g`: the kernel's forward must run on the bits the layer computed."""
    layer = _gdn_layers(tiny_model("qwen3_5"))[0]
    a = torch.randn(2, 9, layer.num_v_heads, requires_grad=True)
    g = -layer.A_log.float().exp() * torch.nn.functional.softplus(a.float() + layer.dt_bias)
    capture = delta_rule._GateCapture()
    capture.layer, capture.a = layer, a
    assert isinstance(capture.gate_for(g), DecayGate)
    for other in (g * 0.5, g[:, :-1], g.clone().index_fill_(1, torch.tensor([4]), 0.0)):
        assert capture.gate_for(other) is other
    with torch.no_grad():
        assert capture.gate_for(g) is g  # without grad the kernel's backward never runs
    capture.a = None
    assert capture.gate_for(g) is g


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_the_block_leaves_the_model_as_it_found_it(tiny_model, family):
    model = tiny_model(family)
    layers = _gdn_layers(model)
    modules = list(model.modules())

    def hooks():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules)

    before = hooks()
    with delta_rule.delta_rule_backward_recomputed(model, lambda: BLOCK_TOKENS):
        inside = hooks()
        with delta_rule.delta_rule_backward_recomputed(model, lambda: BLOCK_TOKENS):
            assert hooks() == inside  # a nested block installs nothing twice
        assert hooks() == inside
    assert inside > before
    assert hooks() == before
    for layer in layers:
        assert "fix_query_key_value_ordering" not in vars(layer)
        assert not hasattr(layer, delta_rule._MARK)
