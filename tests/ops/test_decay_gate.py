"""`DecayGate`: the kernels given the gate's inputs run on the log-decays the layers form, bit for
bit, and differentiate their formation (the float64 comparison is
test_gated_delta_rule_float64.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5

from longstraw.ops.blockwise_backward import gated_delta_rule_recomputed_in_blocks
from longstraw.ops.decay_gate import DecayGate, fp32_log_decays, gate_parts
from longstraw.ops.gated_delta_rule import chunked_gated_delta_rule

B, T, H, DK, DV = 2, 45, 2, 8, 4


def _gate(dtype: torch.dtype = torch.float32) -> DecayGate:
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(B, T, H, generator=gen).to(dtype)
    A_log = torch.linspace(-4.0, 2.0, H).to(dtype)
    dt_bias = (torch.rand(H, generator=gen) + 0.5).to(dtype)
    return DecayGate(a, A_log, dt_bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_is_what_the_layers_compute(dtype):
    gate = _gate(dtype)
    # transformers' Gated DeltaNet (qwen3_5 and qwen3_next alike).
    layers = -gate.A_log.float().exp() * F.softplus(gate.a.float() + gate.dt_bias)
    assert gate.fp32().dtype == torch.float32
    assert torch.equal(gate.fp32(), layers)
    assert gate.shape == gate.a.shape
    assert torch.equal(fp32_log_decays(gate), layers)


def test_gate_parts_of_a_tensor_is_the_tensor():
    g = torch.randn(B, T, H)
    formula, tensors = gate_parts(g)
    assert tensors == (g,) and formula(*tensors) is g
    assert fp32_log_decays(g) is g


def _inputs():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(B, T, H, DK, generator=gen)
    k = torch.randn(B, T, H, DK, generator=gen)
    v = torch.randn(B, T, H, DV, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, DK, DV, generator=gen)
    return q, k, v, beta, h0


def _chunked(q, k, v, g, beta, h0):
    return chunked_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )


def _blockwise(q, k, v, g, beta, h0):
    return gated_delta_rule_recomputed_in_blocks(
        modeling_qwen3_5.torch_chunk_gated_delta_rule,
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        block_tokens=20,
    )


@pytest.mark.parametrize("kernel", [_chunked, _blockwise], ids=["chunked", "blockwise"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_kernels_given_a_gate_compute_the_bits_of_its_log_decays(kernel, grad):
    q, k, v, beta, h0 = _inputs()
    gate = _gate()
    leaves = [x.requires_grad_(grad) for x in (gate.a, gate.A_log, gate.dt_bias)]
    with torch.set_grad_enabled(grad):
        out_gate, state_gate = kernel(q, k, v, DecayGate(*leaves), beta, h0)
        out_g, state_g = kernel(q, k, v, gate.fp32().detach(), beta, h0)
    assert torch.equal(out_gate, out_g) and torch.equal(state_gate, state_g)
    assert out_gate.requires_grad is grad


@pytest.mark.parametrize("kernel", [_chunked, _blockwise], ids=["chunked", "blockwise"])
def test_kernels_given_a_gate_differentiate_its_formation(kernel):
    """The gate's gradients are autograd's through the formula, to fp32 reordering: the kernels
    form them in float64, autograd in fp32."""
    q, k, v, beta, h0 = _inputs()
    gen = torch.Generator().manual_seed(5)
    d_out = torch.randn(B, T, H, DV, generator=gen)
    d_state = torch.randn(B, H, DK, DV, generator=gen)

    def grads(as_gate: bool):
        a, A_log, dt_bias = (x.clone().requires_grad_(True) for x in vars(_gate()).values())
        g = DecayGate(a, A_log, dt_bias)
        out, state = kernel(q, k, v, g if as_gate else g.fp32(), beta, h0)
        loss = (out * d_out).sum() + (state * d_state).sum()
        return torch.autograd.grad(loss, (a, A_log, dt_bias))

    for got, expected in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
