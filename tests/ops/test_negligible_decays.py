"""Decays and UT-transform entries below 2^-500 are zero in the chunked delta rule: strong
decays then leave no subnormal in what the float64 backward keeps, and no gradient changes."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from longstraw.ops import blockwise_backward, gated_delta_rule
from longstraw.ops.gated_delta_rule import chunked_in_float64
from longstraw.ops.gated_delta_rule_vjp import chunked_end_state_in_float64

SMALLEST_NORMAL = torch.finfo(torch.float64).tiny


def _inputs(strongest: float, T=256, Hk=2, Hv=4, D=16):
    """Log-decays uniform in [-strongest, -1] per token; -30 is what Gated DeltaNet's random
    initialisation reaches."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, T, Hk, D, generator=gen)
    k = torch.randn(1, T, Hk, D, generator=gen)
    v = torch.randn(1, T, Hv, D, generator=gen)
    g = -(torch.rand(1, T, Hv, generator=gen) * (strongest - 1) + 1)
    beta = torch.rand(1, T, Hv, generator=gen)
    state = torch.randn(1, Hv, D, D, generator=gen) * 0.5
    return [t.requires_grad_() for t in (q, k, v, g, beta, state)]


def _keep_everything(monkeypatch):
    monkeypatch.setattr(gated_delta_rule, "NEGLIGIBLE", 0.0)
    monkeypatch.setattr(gated_delta_rule, "_LOG_NEGLIGIBLE", float("-inf"))


def _subnormals_kept(inputs) -> int:
    q, k, v, g, beta, state = inputs
    _, kept = chunked_end_state_in_float64(
        q, k, v, g.double(), beta, state.double(), use_qk_l2norm_in_kernel=True
    )
    return sum(((t != 0) & (t.abs() < SMALLEST_NORMAL)).sum().item() for t in kept)


def _blockwise_grads(inputs):
    q, k, v, g, beta, state = inputs
    gen = torch.Generator().manual_seed(5)
    grad_out = torch.randn(1, q.shape[1], v.shape[2], v.shape[3], generator=gen)
    grad_final = torch.randn(state.shape, generator=gen)
    out, final = blockwise_backward.gated_delta_rule_recomputed_in_blocks(
        modeling_qwen3_5.torch_chunk_gated_delta_rule,
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        block_tokens=128,
    )
    return torch.autograd.grad((out, final), inputs, (grad_out, grad_final))


def test_strong_decays_keep_no_subnormal_and_change_no_gradient(monkeypatch):
    inputs = _inputs(strongest=30.0)
    assert _subnormals_kept(inputs) == 0
    zeroed = _blockwise_grads(inputs)

    _keep_everything(monkeypatch)
    assert _subnormals_kept(inputs) > 0, "the inputs no longer reach float64's subnormals"
    kept = _blockwise_grads(inputs)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "state"], zeroed, kept, strict=True):
        assert torch.equal(a, b), f"d{name} changed with the negligible entries zeroed"


@pytest.mark.parametrize("strongest", [0.5, 5.0])
def test_decays_above_the_threshold_zero_nothing(monkeypatch, strongest):
    """Where no decay falls below 2^-500, the float64 kernel's outputs and gradients are the
    same bits with and without the threshold."""
    inputs = _inputs(strongest, T=100)
    q, k, v, g, beta, state = (t.detach().double().requires_grad_() for t in inputs)

    def run():
        out, final = chunked_in_float64(
            q, k, v, g, beta, initial_state=state, use_qk_l2norm_in_kernel=True
        )
        grads = torch.autograd.grad((out.sum() + final.sum()), [q, k, v, g, beta, state])
        return out, final, grads

    out, final, grads = run()
    _keep_everything(monkeypatch)
    out_all, final_all, grads_all = run()
    assert torch.equal(out, out_all) and torch.equal(final, final_all)
    for a, b in zip(grads, grads_all, strict=True):
        assert torch.equal(a, b)
