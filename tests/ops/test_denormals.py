"""Subnormals flushed during the float64 delta-rule backward: on inside, restored after, and the
gradients are those computed with subnormals kept."""

from __future__ import annotations

import contextlib

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from longstraw.ops import blockwise_backward
from longstraw.ops.denormals import denormals_flushed, denormals_flushed_now
from longstraw.ops.gated_delta_rule_vjp import chunked_end_state_in_float64

SMALLEST_NORMAL = torch.finfo(torch.float64).tiny


def test_flushing_is_on_inside_and_restored_after():
    assert not denormals_flushed_now()
    with denormals_flushed():
        assert denormals_flushed_now()
        with denormals_flushed():
            assert denormals_flushed_now()
        assert denormals_flushed_now(), "a nested block turned flushing off on exit"
    assert not denormals_flushed_now()


def test_flushing_left_on_when_it_was_on_before():
    torch.set_flush_denormal(True)
    try:
        with denormals_flushed():
            pass
        assert denormals_flushed_now()
    finally:
        torch.set_flush_denormal(False)


def _strong_decay_inputs(T=256, Hk=2, Hv=4, D=16):
    """Log-decays down to -30 per token (Gated DeltaNet's random initialisation reaches
    that): within a 64-token chunk the UT transform's entries fall into float64's subnormals."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, T, Hk, D, generator=gen)
    k = torch.randn(1, T, Hk, D, generator=gen)
    v = torch.randn(1, T, Hv, D, generator=gen)
    g = -(torch.rand(1, T, Hv, generator=gen) * 29 + 1)
    beta = torch.rand(1, T, Hv, generator=gen)
    state = torch.randn(1, Hv, D, D, generator=gen) * 0.5
    return [t.requires_grad_() for t in (q, k, v, g, beta, state)]


def _blockwise_grads(inputs, grad_out, grad_final):
    q, k, v, g, beta, state = inputs
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


def test_delta_rule_backward_flushes_subnormals_and_keeps_its_gradients(monkeypatch):
    inputs = _strong_decay_inputs()
    q, k, v, g, beta, state = inputs
    _, kept = chunked_end_state_in_float64(
        q, k, v, g.double(), beta, state.double(), use_qk_l2norm_in_kernel=True
    )
    subnormal = sum(((t != 0) & (t.abs() < SMALLEST_NORMAL)).sum().item() for t in kept)
    assert subnormal > 0, "the inputs no longer reach float64's subnormals"

    gen = torch.Generator().manual_seed(5)
    grad_out = torch.randn(1, 256, 4, 16, generator=gen)
    grad_final = torch.randn(1, 4, 16, 16, generator=gen)
    seen = []
    vjp = blockwise_backward.chunked_vjp_in_float64

    def spying(*args, **kwargs):
        seen.append(denormals_flushed_now())
        return vjp(*args, **kwargs)

    monkeypatch.setattr(blockwise_backward, "chunked_vjp_in_float64", spying)
    flushed = _blockwise_grads(inputs, grad_out, grad_final)
    assert seen and all(seen), f"flushing during the blocks' products: {seen}"
    assert not denormals_flushed_now()

    seen.clear()
    monkeypatch.setattr(blockwise_backward, "denormals_flushed", contextlib.nullcontext)
    kept_subnormals = _blockwise_grads(inputs, grad_out, grad_final)
    assert seen and not any(seen)
    for name, a, b in zip(
        ["q", "k", "v", "g", "beta", "state"], flushed, kept_subnormals, strict=True
    ):
        assert torch.equal(a, b), f"d{name} changed with subnormals flushed"
