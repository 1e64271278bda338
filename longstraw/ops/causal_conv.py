"""Depthwise causal conv1d over one shard, started from the previous shard's conv state.

Gated DeltaNet (qwen3_5 / qwen3_next) runs a depthwise causal conv of kernel K over the
concatenated q/k/v projections before the gated delta rule. Prefilled shard by shard, each
shard needs the last K-1 inputs of everything before it; this module takes them from a conv
state and returns the next one as a new tensor (never written in place: the prompt's state is
shared by every branch and saved for backward).

Conv-state convention — the same as transformers 5.24's `LinearAttentionLayer.conv_states`
(`cache_utils.update_conv_state`, `causal_conv1d_update`): the state is the last S raw
conv *inputs* (before the conv, before the activation), oldest first, in the inputs' dtype,
left-padded with zeros while fewer than S inputs have been seen. transformers keeps
S = K (one more than the conv reads); that is the default here, so states compare bitwise with
a transformers cache. Any S >= K-1 works: only the last K-1 columns are read.

Legend: B batch, C channels (conv_dim = 2 * key_dim + value_dim), T tokens in this shard,
K kernel size, S state length (>= K-1; K by default).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw.ops import dispatch

_ACTIVATIONS = {None: lambda y: y, "silu": F.silu, "swish": F.silu}


def _check_inputs(x_BCT, weight_CK, bias_C, conv_state_BCS, activation) -> None:
    if x_BCT.ndim != 3 or weight_CK.ndim != 2 or weight_CK.shape[0] != x_BCT.shape[1]:
        raise ValueError(
            f"x must be [B, C, T] and weight [C, K] (squeeze the conv1d weight's middle dim); "
            f"got {tuple(x_BCT.shape)} and {tuple(weight_CK.shape)}"
        )
    if bias_C is not None and tuple(bias_C.shape) != (weight_CK.shape[0],):
        raise ValueError(f"bias must be [C] = [{weight_CK.shape[0]}]; got {tuple(bias_C.shape)}")
    K = weight_CK.shape[1]
    if conv_state_BCS is not None and (
        conv_state_BCS.ndim != 3
        or conv_state_BCS.shape[:2] != x_BCT.shape[:2]
        or conv_state_BCS.shape[2] < K - 1
    ):
        raise ValueError(
            f"conv_state must be [B, C, S] = [{x_BCT.shape[0]}, {x_BCT.shape[1]}, S] with "
            f"S >= kernel-1 = {K - 1}; got {tuple(conv_state_BCS.shape)}"
        )
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(_ACTIVATIONS)}; got {activation!r}")


def _history(x_BCT, conv_state_BCS, state_len):
    """[state ; x] in x's dtype, with a zero state of `state_len` (default K) when None."""
    if conv_state_BCS is None:
        conv_state_BCS = x_BCT.new_zeros(*x_BCT.shape[:2], state_len)
    return torch.cat([conv_state_BCS.to(x_BCT.dtype), x_BCT], dim=-1)


def causal_conv1d_with_state(
    x_BCT: torch.Tensor,
    weight_CK: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    conv_state_BCS: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    state_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv of one shard: y_t = act(bias + sum_k weight[:, k] x_{t-K+1+k}).

    `conv_state_BCS` is the previous shard's returned state (None: nothing before, zeros).
    `state_len` sets S when `conv_state_BCS` is None (default K, transformers' convention);
    otherwise the returned state has the given state's length. Any T >= 1 (T < K-1 too: the
    state then still holds inputs of earlier shards). Computed in weight's dtype, returned in
    x's dtype like transformers' `causal_conv1d_fn`. Returns (y [B, C, T], new state [B, C, S]),
    both new tensors; differentiable w.r.t. x, weight, bias and conv_state.

    The conv is K shifted multiply-adds rather than F.conv1d, so before the activation every
    output element is the same sequence of fp ops however the sequence is sharded (sharded ==
    one pass bitwise, tested); silu's vectorised and scalar CPU kernels differ in the last ulp,
    so after it sharded and one pass agree to fp32 rounding, as F.conv1d does.

    On CUDA without autograd, causal-conv1d's kernel computes y when installed
    (`longstraw.ops.dispatch`; not yet run on a GPU); the state is the same either way.
    """
    _check_inputs(x_BCT, weight_CK, bias_C, conv_state_BCS, activation)
    K = weight_CK.shape[1]
    if state_len is None:
        state_len = K if conv_state_BCS is None else conv_state_BCS.shape[2]
    elif conv_state_BCS is not None and state_len != conv_state_BCS.shape[2]:
        raise ValueError(
            f"state_len={state_len} disagrees with conv_state's length {conv_state_BCS.shape[2]}; "
            "pass one or the other"
        )
    if state_len < K - 1:
        raise ValueError(f"state_len must be >= kernel-1 = {K - 1}; got {state_len}")
    T = x_BCT.shape[2]
    hist_BCL = _history(x_BCT, conv_state_BCS, state_len)
    # clone: the state must not keep the whole shard's history alive through a view.
    new_state_BCS = hist_BCL[:, :, hist_BCL.shape[2] - state_len :].clone()
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x_BCT, weight_CK, bias_C, conv_state_BCS)
    )
    kernel = dispatch.causal_conv_kernel(x_BCT.device, K, activation, needs_grad)
    if dispatch.ran("linear_attention.conv", kernel) == dispatch.CAUSAL_CONV1D:
        initial = (
            None if conv_state_BCS is None else hist_BCL[:, :, state_len - (K - 1) : state_len]
        )
        y_BCT = dispatch.causal_conv1d_partial(x_BCT, weight_CK, bias_C, initial, activation)
        return y_BCT, new_state_BCS

    # The K-1 + T inputs the outputs read; window of output t is xk[:, :, t : t + K].
    xk_BCL = hist_BCL[:, :, hist_BCL.shape[2] - (K - 1 + T) :].to(weight_CK.dtype)
    y_BCT = xk_BCL[:, :, 0:T] * weight_CK[:, 0, None]
    for j in range(1, K):
        # In place on our own fresh accumulator (autograd saves only xk and weight): 2x faster
        # than `y = y + x * w` and than F.conv1d on CPU (C=10240, T=4096: 0.07 s vs 0.15 s).
        y_BCT.addcmul_(xk_BCL[:, :, j : j + T], weight_CK[:, j, None])
    if bias_C is not None:
        y_BCT = y_BCT + bias_C[:, None]
    y_BCT = _ACTIVATIONS[activation](y_BCT).to(x_BCT.dtype)
    return y_BCT, new_state_BCS


def naive_causal_conv1d(
    x_BCT: torch.Tensor,
    weight_CK: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    conv_state_BCS: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    state_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: concatenate the whole history [state ; x], run transformers' own conv
    (F.conv1d, groups=C, padding K-1, keep the first L outputs), keep the last T outputs."""
    _check_inputs(x_BCT, weight_CK, bias_C, conv_state_BCS, activation)
    C, K = weight_CK.shape
    if state_len is None:
        state_len = K if conv_state_BCS is None else conv_state_BCS.shape[2]
    T = x_BCT.shape[2]
    hist_BCL = _history(x_BCT, conv_state_BCS, state_len)
    L = hist_BCL.shape[2]
    y_BCL = F.conv1d(
        hist_BCL.to(weight_CK.dtype), weight_CK.unsqueeze(1), bias_C, padding=K - 1, groups=C
    )[:, :, :L]
    y_BCT = _ACTIVATIONS[activation](y_BCL[:, :, L - T :]).to(x_BCT.dtype)
    return y_BCT, hist_BCL[:, :, L - state_len :].clone()
