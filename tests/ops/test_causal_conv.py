"""Sharded causal conv with a carried state vs the whole-history reference and transformers 5.24."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5

from longstraw.ops.causal_conv import causal_conv1d_with_state, naive_causal_conv1d

RTOL, ATOL = 1e-5, 1e-6  # fp32 reorderings (docs/design.md)
GRAD_RMS_REL = 1e-6


def _assert_close(actual, expected, what, rtol=RTOL, atol=ATOL):
    diff = (actual.double() - expected.double()).abs()
    assert torch.allclose(actual, expected, rtol=rtol, atol=atol), (
        f"{what}: max_diff={diff.max().item():.3e} mean_diff={diff.mean().item():.3e}"
    )


def _inputs(B=2, C=12, T=56, K=4, *, with_bias=True, with_state=False, seed=42):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, T, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    bias = torch.randn(C, generator=gen) if with_bias else None
    state = torch.randn(B, C, K, generator=gen) if with_state else None
    return x, weight, bias, state


def _sharded(fn, x, weight, bias, state, sizes, activation="silu"):
    ys, start = [], 0
    for n in sizes:
        y, state = fn(x[:, :, start : start + n], weight, bias, state, activation)
        ys.append(y)
        start += n
    assert start == x.shape[2]
    return torch.cat(ys, dim=2), state


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_sharded_causal_conv_matches_one_pass_and_naive(with_state, with_bias, activation):
    """Shards of 1, 2, 3 (< kernel-1: the state spans shards) and 50 tokens, kernel 4."""
    x, weight, bias, state = _inputs(with_bias=with_bias, with_state=with_state)
    sizes = (1, 2, 3, 50)
    y, new_state = _sharded(causal_conv1d_with_state, x, weight, bias, state, sizes, activation)
    y_one, state_one = causal_conv1d_with_state(x, weight, bias, state, activation)
    y_naive, state_naive = naive_causal_conv1d(x, weight, bias, state, activation)
    y_naive_sharded, _ = _sharded(naive_causal_conv1d, x, weight, bias, state, sizes, activation)
    if activation is None:
        # Shift-and-add: the same fp ops per element however it is sharded.
        assert torch.equal(y, y_one)
    # silu's vectorised and scalar-tail kernels differ in the last ulp, and where the tail
    # falls depends on the shard length (measured max_diff 2.4e-7).
    _assert_close(y, y_one, "sharded vs one pass")
    assert torch.equal(new_state, state_one) and torch.equal(new_state, state_naive)
    _assert_close(y_one, y_naive, "one pass vs naive")
    _assert_close(y_naive_sharded, y_naive, "naive sharded vs naive")
    history = x if state is None else torch.cat([state, x], dim=2)
    assert torch.equal(new_state, history[:, :, -4:])


@pytest.mark.parametrize("T", [1, 2, 3, 1000])
def test_causal_conv_state_is_last_kernel_inputs_zero_padded(T):
    """transformers' convention: the last K raw inputs, oldest first, zeros before the start."""
    x, weight, bias, _ = _inputs(T=T)
    _, state = causal_conv1d_with_state(x, weight, bias, None, "silu")
    expected = F.pad(x, (max(0, 4 - T), 0))[:, :, -4:]
    assert torch.equal(state, expected)


def test_causal_conv_gradients_match_naive_including_state():
    x, weight, bias, state = _inputs(T=63, with_state=True)
    gen = torch.Generator().manual_seed(43)
    d_y, d_state = torch.randn(2, 12, 63, generator=gen), torch.randn(2, 12, 4, generator=gen)
    grads = {}
    for name, fn in (("sharded", causal_conv1d_with_state), ("naive", naive_causal_conv1d)):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias, state)]
        sizes = (1, 2, 3, 57) if name == "sharded" else (63,)
        y, new_state = _sharded(fn, *leaves, sizes)
        ((y * d_y).sum() + (new_state * d_state).sum()).backward()
        grads[name] = [t.grad for t in leaves]
    for arg, got, ref in zip(("x", "weight", "bias", "state"), *grads.values(), strict=True):
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel <= GRAD_RMS_REL, (
            f"d{arg}: rms_rel={rel:.3e} max_diff={(got - ref).abs().max():.3e}"
        )


def test_causal_conv_leaves_inputs_unchanged_and_returns_new_state():
    x, weight, bias, state = _inputs(T=3, with_state=True)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias, state)]
    y, new_state = causal_conv1d_with_state(*leaves, "silu")
    (y.sum() + new_state.sum()).backward()
    for t, t0 in zip(leaves, (x, weight, bias, state), strict=True):
        assert torch.equal(t.detach(), t0)
    assert new_state.data_ptr() != leaves[3].data_ptr()
    assert new_state.data_ptr() != leaves[0].data_ptr()


def test_causal_conv_keeps_any_state_length_of_at_least_kernel_minus_one():
    x, weight, bias, _ = _inputs(T=50)
    y_k, _ = causal_conv1d_with_state(x, weight, bias, None, "silu")
    y, state = causal_conv1d_with_state(x[:, :, :20], weight, bias, None, "silu", state_len=3)
    assert state.shape == (2, 12, 3)
    y2, state2 = causal_conv1d_with_state(x[:, :, 20:], weight, bias, state, "silu")
    assert state2.shape == (2, 12, 3)
    assert torch.equal(torch.cat([y, y2], dim=2), y_k)
    with pytest.raises(ValueError, match="kernel-1"):
        causal_conv1d_with_state(x, weight, bias, state[:, :, :2], "silu")
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_with_state(x, weight, bias, None, "gelu")


def _tiny_qwen3_5_layer():
    config = Qwen3_5TextConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, intermediate_size=128, vocab_size=128,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(42)
    return config, modeling_qwen3_5.Qwen3_5GatedDeltaNet(config, layer_idx=0)


def test_causal_conv_matches_transformers_qwen3_5_layer_conv_and_cache_state():
    """No-cache path `silu(conv1d(x)[..., :T])`, the cached 1-token `causal_conv1d_update`, and
    the conv state a transformers cache holds after each shard, on a tiny random Qwen3.5 layer."""
    config, layer = _tiny_qwen3_5_layer()
    weight_CK, bias, act = layer.conv1d.weight.squeeze(1), layer.conv1d.bias, layer.activation
    hidden = torch.randn(2, 57, 64)
    with torch.no_grad():
        mixed_BCT = layer.in_proj_qkv(hidden).transpose(1, 2)
        ref = F.silu(layer.conv1d(mixed_BCT)[..., :57])
        y, _ = causal_conv1d_with_state(mixed_BCT, weight_CK, bias, None, act)
        _assert_close(y, ref, "no-cache conv")

        # Shards (2, 1, 3, 50, 1): shorter than the kernel first, then the 1-token update path.
        cache = DynamicCache(config=config)
        state, start = None, 0
        for n in (2, 1, 3, 50, 1):
            sl = slice(start, start + n)
            step_state = None if state is None else state.clone()
            # Projected per shard, as the layer does: a matmul over fewer rows rounds differently.
            shard_BCT = layer.in_proj_qkv(hidden[:, sl]).transpose(1, 2)
            y, state = causal_conv1d_with_state(shard_BCT, weight_CK, bias, state, act)
            _assert_close(y, ref[:, :, sl], f"shard at {start}")
            layer(hidden[:, sl], cache=cache)
            assert torch.equal(state, cache.layers[0].conv_states[0]), (
                f"conv state after {start + n}"
            )
            if n == 1 and step_state is not None:
                hf_y = modeling_qwen3_5.causal_conv1d_update(
                    shard_BCT, step_state, weight_CK, bias, act
                )
                _assert_close(y, hf_y, "1-token causal_conv1d_update")
            start += n
