"""Chunked gated delta rule vs the per-token reference and vs transformers 5.24's own functions."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5

from longstraw.ops.gated_delta_rule import chunked_gated_delta_rule, naive_gated_delta_rule

# fp32 reorderings (docs/design.md). Gradients: RMS-relative, measured ≤ 4.9e-7 (dg, T=200).
RTOL, ATOL = 1e-5, 1e-6
GRAD_RMS_REL = 2e-6


def _assert_close(actual, expected, what, rtol=RTOL, atol=ATOL):
    diff = (actual.double() - expected.double()).abs()
    assert torch.allclose(actual, expected, rtol=rtol, atol=atol), (
        f"{what}: max_diff={diff.max().item():.3e} mean_diff={diff.mean().item():.3e}"
    )


def _assert_rms_close(actual, expected, what, tol=GRAD_RMS_REL):
    rel = (actual - expected).double().norm() / expected.double().norm().clamp_min(1e-30)
    diff = (actual.double() - expected.double()).abs()
    assert rel <= tol, (
        f"{what}: rms_rel={rel.item():.3e} max_diff={diff.max().item():.3e} "
        f"mean_diff={diff.mean().item():.3e}"
    )


def _inputs(B, T, Hk, Hv, Dk, Dv, *, l2norm, with_state, seed=42, dtype=torch.float32):
    """Inputs in the regime the model produces: g = -A * softplus(.) <= 0, beta = sigmoid(.);
    without in-kernel l2norm, keys come in roughly unit-norm (the delta rule diverges else)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 1.0 if l2norm else Dk**-0.5
    q = torch.randn(B, T, Hk, Dk, generator=gen) * scale
    k = torch.randn(B, T, Hk, Dk, generator=gen) * scale
    v = torch.randn(B, T, Hv, Dv, generator=gen)
    A = torch.rand(Hv, generator=gen) * 2 + 0.05
    g = -A * torch.nn.functional.softplus(torch.randn(B, T, Hv, generator=gen) - 2)
    beta = torch.randn(B, T, Hv, generator=gen).sigmoid()
    h0 = torch.randn(B, Hv, Dk, Dv, generator=gen) * 0.5 if with_state else None
    q, k, v = (x.to(dtype) for x in (q, k, v))
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 1000])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize(("Hk", "Hv"), [(2, 2), (2, 4), (3, 3)])
def test_chunked_gated_delta_rule_matches_naive(T, l2norm, with_state, Hk, Hv):
    q, k, v, g, beta, h0 = _inputs(2, T, Hk, Hv, 16, 24, l2norm=l2norm, with_state=with_state)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    out, state = chunked_gated_delta_rule(q, k, v, g, beta, **kw)
    ref_out, ref_state = naive_gated_delta_rule(q, k, v, g, beta, **kw)
    assert out.shape == (2, T, Hv, 24) and state.shape == (2, Hv, 16, 24)
    assert state.dtype == torch.float32
    _assert_close(out, ref_out, "output")
    _assert_close(state, ref_state, "final state")


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("with_state", [True, False])
def test_chunked_gated_delta_rule_matches_transformers_chunked(T, with_state):
    q, k, v, g, beta, h0 = _inputs(2, T, 2, 4, 16, 24, l2norm=True, with_state=with_state)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = chunked_gated_delta_rule(q, k, v, g, beta, **kw)
    hf_out, hf_state = modeling_qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    # Measured max_diff ≤ 5.7e-7 (outputs and states of magnitude ~1).
    _assert_close(out, hf_out, "output")
    _assert_close(state, hf_state, "final state")


def test_one_token_step_matches_transformers_recurrent_step():
    q, k, v, g, beta, h0 = _inputs(3, 1, 2, 4, 16, 24, l2norm=True, with_state=True)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = chunked_gated_delta_rule(q, k, v, g, beta, **kw)
    hf_out, hf_state = modeling_qwen3_5.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    _assert_close(out, hf_out, "output")
    _assert_close(state, hf_state, "final state")


@pytest.mark.parametrize("T", [1, 63, 65, 200])
@pytest.mark.parametrize("l2norm", [True, False])
def test_chunked_gated_delta_rule_gradients_match_naive(T, l2norm):
    """All input gradients, dh0 included, from a loss on the outputs and the final state (dht)."""
    base = _inputs(2, T, 2, 4, 16, 24, l2norm=l2norm, with_state=True)
    gen = torch.Generator().manual_seed(43)
    d_out = torch.randn(2, T, 4, 24, generator=gen)
    d_state = torch.randn(2, 4, 16, 24, generator=gen)
    grads = {}
    for name, fn in (("chunked", chunked_gated_delta_rule), ("naive", naive_gated_delta_rule)):
        xs = [x.clone().requires_grad_() for x in base]
        out, state = fn(
            *xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm_in_kernel=l2norm
        )
        ((out * d_out).sum() + (state * d_state).sum()).backward()
        grads[name] = [x.grad for x in xs]
    for arg, got, ref in zip(
        ("q", "k", "v", "g", "beta", "h0"), grads["chunked"], grads["naive"], strict=True
    ):
        _assert_rms_close(got, ref, f"d{arg}")


def _sharded(fn, q, k, v, g, beta, h0, sizes, l2norm):
    outs, state, start = [], h0, 0
    for n in sizes:
        sl = slice(start, start + n)
        out, state = fn(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
        )  # fmt: skip
        outs.append(out)
        start += n
    assert start == q.shape[1]
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize(
    "sizes", [(1, 2, 3, 57), (1, 2, 3, 57, 64, 65, 200, 607)], ids=["63", "1000"]
)
def test_sharded_chunked_gated_delta_rule_matches_one_pass(sizes):
    """Prefill shard by shard, carrying the state, gives one pass's outputs, state and dh0."""
    T = sum(sizes)
    base = _inputs(2, T, 2, 4, 16, 24, l2norm=True, with_state=True)
    gen = torch.Generator().manual_seed(43)
    d_out, d_state = (
        torch.randn(2, T, 4, 24, generator=gen),
        torch.randn(2, 4, 16, 24, generator=gen),
    )
    results = {}
    for name, shard_sizes in (("sharded", sizes), ("one pass", (T,))):
        xs = [x.clone().requires_grad_() for x in base]
        out, state = _sharded(chunked_gated_delta_rule, *xs, shard_sizes, l2norm=True)
        ((out * d_out).sum() + (state * d_state).sum()).backward()
        results[name] = (out.detach(), state.detach(), xs[5].grad, xs[2].grad)
    (out, state, dh0, dv), (ref_out, ref_state, ref_dh0, ref_dv) = results.values()
    _assert_close(out, ref_out, "output")
    _assert_close(state, ref_state, "final state")
    _assert_rms_close(dh0, ref_dh0, "dh0")
    _assert_rms_close(dv, ref_dv, "dv")


@pytest.mark.parametrize("fn", [chunked_gated_delta_rule, naive_gated_delta_rule])
def test_gated_delta_rule_leaves_inputs_bitwise_unchanged(fn):
    base = _inputs(2, 65, 2, 4, 16, 24, l2norm=True, with_state=True)
    xs = [x.clone().requires_grad_() for x in base]
    out, state = fn(
        *xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    (out.sum() + state.sum()).backward()
    for x, x0 in zip(xs, base, strict=True):
        assert torch.equal(x.detach(), x0)
    assert state.data_ptr() != xs[5].data_ptr()


def test_chunked_gated_delta_rule_is_deterministic():
    q, k, v, g, beta, h0 = _inputs(2, 1000, 2, 4, 16, 24, l2norm=True, with_state=True)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    first, second = (chunked_gated_delta_rule(q, k, v, g, beta, **kw) for _ in range(2))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_chunked_gated_delta_rule_keeps_transformers_dtypes():
    """bf16 q/k/v: output in bf16, state in fp32, as transformers returns them."""
    q, k, v, g, beta, h0 = _inputs(
        1, 65, 2, 4, 16, 24, l2norm=True, with_state=True, dtype=torch.bfloat16
    )
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = chunked_gated_delta_rule(q, k, v, g, beta, **kw)
    hf_out, hf_state = modeling_qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert out.dtype == hf_out.dtype == torch.bfloat16
    assert state.dtype == hf_state.dtype == torch.float32
    _assert_close(out.float(), hf_out.float(), "bf16 output", rtol=2e-2, atol=2e-2)
    assert chunked_gated_delta_rule(q, k, v, g, beta)[1] is None


def test_gated_delta_rule_refuses_packed_sequences_and_bad_shapes():
    q, k, v, g, beta, h0 = _inputs(1, 5, 2, 4, 16, 24, l2norm=True, with_state=True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunked_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="initial_state"):
        chunked_gated_delta_rule(q, k, v, g, beta, initial_state=h0[:, :2])
    with pytest.raises(ValueError, match="multiple"):
        naive_gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])


def test_qwen3_5_layer_with_chunked_rule_matches_transformers(monkeypatch):
    """Installed in place of transformers' function, the Gated DeltaNet layer's output is unchanged."""
    config = Qwen3_5TextConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, intermediate_size=128, vocab_size=128,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(42)
    layer = modeling_qwen3_5.Qwen3_5GatedDeltaNet(config, layer_idx=0)
    hidden = torch.randn(2, 100, 64)
    with torch.no_grad():
        ref = layer(hidden)
        monkeypatch.setattr(
            modeling_qwen3_5, "torch_chunk_gated_delta_rule", chunked_gated_delta_rule
        )
        out = layer(hidden)
    _assert_close(out, ref, "layer output")
