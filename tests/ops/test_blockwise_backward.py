"""Blockwise-recomputed backward (MLP rows, gated delta rule) against plain autograd.

The forward must be the wrapped function's own output bitwise (the sweep checks the recomputed
shard against the stored state); the gradients must be plain autograd's to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from longstraw.ops.blockwise_backward import (
    GatedMlp,
    LowRank,
    OutputProjection,
    gated_delta_rule_recomputed_in_blocks,
    rows_recomputed_in_blocks,
)

GRAD_RTOL = 2e-6  # relative to the largest entry of each gradient (fp32 reordering)


def _assert_grads_close(actual, expected, what):
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        scale = e.abs().max().clamp_min(1e-30)
        rel = ((a - e).abs().max() / scale).item()
        assert rel <= GRAD_RTOL, f"{what} grad {i}: max_diff / max|ref| = {rel:.3e}"


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.SiLU(), torch.nn.Linear(40, 16))


@pytest.mark.parametrize(("tokens", "block"), [(77, 10), (64, 64), (5, 256), (33, 1)])
def test_rows_recomputed_in_blocks_matches_autograd(tokens, block):
    mlp = _mlp()
    x = torch.randn(2, tokens, 16, requires_grad=True)
    grad_out = torch.randn(2, tokens, 16)
    expected_out = mlp(x)
    expected = torch.autograd.grad(expected_out, [x, *mlp.parameters()], grad_out)

    out = rows_recomputed_in_blocks(mlp, x, list(mlp.parameters()), block_tokens=block)
    assert torch.equal(out, expected_out.detach())
    actual = torch.autograd.grad(out, [x, *mlp.parameters()], grad_out)
    _assert_grads_close(actual, expected, f"mlp T={tokens} block={block}")


@pytest.mark.parametrize(("tokens", "block"), [(77, 10), (64, 64), (5, 256), (33, 1)])
def test_output_projection_by_hand_matches_autograd(tokens, block):
    """The last linear layer's gradients taken by hand (its input recomputed, not its output)."""
    mlp = _mlp()
    inner, projection = mlp[:2], mlp[2]
    x = torch.randn(2, tokens, 16, requires_grad=True)
    grad_out = torch.randn(2, tokens, 16)
    expected_out = mlp(x)
    expected = torch.autograd.grad(expected_out, [x, *mlp.parameters()], grad_out)

    out = rows_recomputed_in_blocks(
        mlp,
        x,
        list(mlp.parameters()),
        block_tokens=block,
        split=OutputProjection(inner, projection),
    )
    assert torch.equal(out, expected_out.detach())
    actual = torch.autograd.grad(out, [x, *mlp.parameters()], grad_out)
    _assert_grads_close(actual, expected, f"mlp by hand T={tokens} block={block}")


def _gated_mlp(dtype=torch.float32) -> tuple[GatedMlp, torch.nn.Module]:
    torch.manual_seed(0)
    gate, up, down = (
        torch.nn.Linear(16, 40, bias=False, dtype=dtype),
        torch.nn.Linear(16, 40, bias=False, dtype=dtype),
        torch.nn.Linear(40, 16, bias=False, dtype=dtype),
    )
    parts = GatedMlp(gate, up, down)

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = gate, up, down

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

    return parts, Mlp()


@pytest.mark.parametrize(("tokens", "block"), [(77, 10), (64, 64), (5, 256), (33, 1)])
def test_gated_mlp_by_hand_matches_float64_autograd(tokens, block):
    """Every gradient of the gated MLP written out (one stacked gate/up matmul, SiLU's
    derivative by hand): float64 autograd's to float64 rounding; in fp32 within fp32 reordering
    of it; the forward is the module's own, bitwise."""
    for dtype, rtol in ((torch.float64, 1e-13), (torch.float32, GRAD_RTOL)):
        parts, mlp = _gated_mlp(dtype)
        x = torch.randn(2, tokens, 16, dtype=dtype, requires_grad=True)
        grad_out = torch.randn(2, tokens, 16, dtype=dtype)
        params = list(mlp.parameters())
        expected_out = mlp(x)
        expected = torch.autograd.grad(expected_out, [x, *params], grad_out)

        out = rows_recomputed_in_blocks(mlp, x, params, block_tokens=block, split=parts)
        assert torch.equal(out, expected_out.detach())
        actual = torch.autograd.grad(out, [x, *params], grad_out)
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert a.dtype == e.dtype
            rel = ((a - e).abs().max() / e.abs().max()).item()
            assert rel <= rtol, f"{dtype} T={tokens} block={block} grad {i}: {rel:.3e}"


def test_gated_mlp_by_hand_skips_frozen_weights_and_input():
    parts, mlp = _gated_mlp()
    mlp.up.weight.requires_grad_(False)
    x = torch.randn(1, 12, 16)
    trainable = [mlp.gate.weight, mlp.down.weight]
    out = rows_recomputed_in_blocks(mlp, x, trainable, block_tokens=5, split=parts)
    grads = torch.autograd.grad(out, trainable, torch.ones_like(out))
    expected = torch.autograd.grad(mlp(x), trainable, torch.ones_like(out))
    _assert_grads_close(grads, expected, "gated mlp, up frozen, x without grad")


def _adapted_gated_mlp(dtype, adapted: tuple[bool, bool, bool], frozen_base: bool):
    """A gated MLP whose projections carry LoRA-style adapters (output += s (x Aᵀ) Bᵀ) where
    `adapted` says, as `GatedMlp` parts and the module computing it, with its trainable
    parameters."""
    parts, mlp = _gated_mlp(dtype)
    generator = torch.Generator().manual_seed(1)
    low_rank, factors = [], []
    for on, linear, scale in zip(
        adapted, (mlp.gate, mlp.up, mlp.down), (2.0, 0.5, 4.0), strict=True
    ):
        if not on:
            low_rank.append(None)
            factors.append(None)
            continue
        a = torch.nn.Parameter(torch.randn(3, linear.in_features, generator=generator, dtype=dtype))
        b = torch.nn.Parameter(
            torch.randn(linear.out_features, 3, generator=generator, dtype=dtype)
        )
        low_rank.append(LowRank(a, b, scale))
        factors.append((a, b, scale))
    if frozen_base:
        for linear in (mlp.gate, mlp.up, mlp.down):
            linear.weight.requires_grad_(False)

    def project(linear, parts, x):
        out = linear(x)
        if parts is not None:
            a, b, scale = parts
            out = out + (x @ a.T) @ b.T * scale
        return out

    def fn(x):
        gate = project(mlp.gate, factors[0], x)
        up = project(mlp.up, factors[1], x)
        return project(mlp.down, factors[2], torch.nn.functional.silu(gate) * up)

    params = [p for p in mlp.parameters() if p.requires_grad]
    params += [t for f in factors if f is not None for t in f[:2]]
    split = GatedMlp(parts.gate, parts.up, parts.down, low_rank=tuple(low_rank))
    return split, fn, params


@pytest.mark.parametrize(
    "adapted", [(True, True, True), (True, False, False), (False, False, True)]
)
@pytest.mark.parametrize("frozen_base", [True, False])
def test_gated_mlp_with_low_rank_adapters_by_hand_matches_float64_autograd(adapted, frozen_base):
    """LoRA adapters on any of the three projections, taken by hand with the MLP (the sweep's
    path for peft's `lora.Linear`): every adapter's, weight's and the input's gradient is
    autograd's, to float64 rounding in float64 and fp32 reordering in fp32."""
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, GRAD_RTOL)):
        split, fn, params = _adapted_gated_mlp(dtype, adapted, frozen_base)
        x = torch.randn(2, 41, 16, dtype=dtype, requires_grad=True)
        grad_out = torch.randn(2, 41, 16, dtype=dtype)
        expected_out = fn(x)
        expected = torch.autograd.grad(expected_out, [x, *params], grad_out)
        out = rows_recomputed_in_blocks(fn, x, params, block_tokens=9, split=split)
        assert torch.equal(out, expected_out.detach())
        actual = torch.autograd.grad(out, [x, *params], grad_out)
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            rel = ((a - e).abs().max() / e.abs().max()).item()
            assert rel <= rtol, f"{dtype} {adapted} frozen={frozen_base} grad {i}: {rel:.3e}"


def test_rows_recomputed_in_blocks_keeps_only_the_input_for_backward():
    mlp = _mlp()
    x = torch.randn(1, 300, 16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rows_recomputed_in_blocks(mlp, x, list(mlp.parameters()), block_tokens=32)
    assert saved == [(1, 300, 16)], f"saved for backward: {saved}"


def test_rows_without_grad_is_the_plain_call():
    mlp = _mlp()
    x = torch.randn(1, 9, 16)
    with torch.no_grad():
        out = rows_recomputed_in_blocks(mlp, x, list(mlp.parameters()))
    assert not out.requires_grad and torch.equal(out, mlp(x).detach())


def _delta_rule_inputs(T, Hk=2, Hv=4, Dk=16, Dv=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, T, Hk, Dk, generator=gen, dtype=dtype)
    k = torch.randn(1, T, Hk, Dk, generator=gen, dtype=dtype)
    v = torch.randn(1, T, Hv, Dv, generator=gen, dtype=dtype)
    g = -torch.rand(1, T, Hv, generator=gen) * 0.5
    beta = torch.rand(1, T, Hv, generator=gen)
    state = torch.randn(1, Hv, Dk, Dv, generator=gen) * 0.5
    return [t.requires_grad_() for t in (q, k, v, g, beta, state)]


@pytest.mark.parametrize(("tokens", "block"), [(300, 70), (300, 64), (65, 256), (40, 1)])
def test_gated_delta_rule_recomputed_in_blocks_matches_autograd(tokens, block):
    """Against autograd through transformers' own chunked delta rule, with a carried initial
    state and a cotangent on the final state (what the sweep backpropagates)."""
    original = modeling_qwen3_5.torch_chunk_gated_delta_rule
    q, k, v, g, beta, state = _delta_rule_inputs(tokens)
    gen = torch.Generator().manual_seed(3)
    grad_out = torch.randn(1, tokens, 4, 8, generator=gen)
    grad_final = torch.randn(1, 4, 16, 8, generator=gen)
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)

    ref_out, ref_final = original(q, k, v, g=g, beta=beta, **kwargs)
    expected = torch.autograd.grad(
        (ref_out, ref_final), [q, k, v, g, beta, state], (grad_out, grad_final)
    )

    out, final = gated_delta_rule_recomputed_in_blocks(
        original, q, k, v, g=g, beta=beta, block_tokens=block, **kwargs
    )
    assert torch.equal(out, ref_out.detach()) and torch.equal(final, ref_final.detach())
    actual = torch.autograd.grad((out, final), [q, k, v, g, beta, state], (grad_out, grad_final))
    _assert_grads_close(actual, expected, f"delta rule T={tokens} block={block}")


def test_gated_delta_rule_blocks_without_final_state_or_initial_state():
    original = modeling_qwen3_5.torch_chunk_gated_delta_rule
    q, k, v, g, beta, _ = _delta_rule_inputs(150)
    grad_out = torch.randn(1, 150, 4, 8)
    ref_out, _ = original(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    expected = torch.autograd.grad(ref_out, [q, k, v, g, beta], grad_out)
    out, final = gated_delta_rule_recomputed_in_blocks(
        original, q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, block_tokens=40
    )
    assert final is None
    actual = torch.autograd.grad(out, [q, k, v, g, beta], grad_out)
    _assert_grads_close(actual, expected, "delta rule, zero initial state")


@pytest.mark.parametrize("bad", [0, -3])
def test_block_tokens_must_be_positive(bad):
    mlp = _mlp()
    with pytest.raises(ValueError, match="block_tokens"):
        rows_recomputed_in_blocks(mlp, torch.randn(1, 4, 16), [], block_tokens=bad)
    q, k, v, g, beta, _ = _delta_rule_inputs(4)
    with pytest.raises(ValueError, match="block_tokens"):
        gated_delta_rule_recomputed_in_blocks(
            modeling_qwen3_5.torch_chunk_gated_delta_rule, q, k, v, g, beta, block_tokens=bad
        )
