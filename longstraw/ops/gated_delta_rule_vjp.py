"""The chunked gated delta rule's vector-Jacobian product in float64, written out by hand.

`chunked_vjp_in_float64` returns what `torch.autograd.grad` through `chunked_in_float64`
(`longstraw.ops.gated_delta_rule`) returns for the same inputs and cotangents, to float64
rounding: the same chunked (WY/UT) form, every operation in float64. It is what the blockwise
backward runs for each block (`longstraw.ops.blockwise_backward`). Against autograd it does less:

- no output: the forward part computes only what the backward reads (the UT transform, the
  states entering each chunk and the new values `vn`); the intra-chunk attention `q k^T` is
  formed once, in the backward;
- the chunks are batched in every step but the two sequential scans (forward for the states,
  backward for their cotangent), and each chunk's pieces are views, so nothing is zero-filled
  or copied per chunk;
- autograd runs only where the inputs enter: the preamble (l2 norm, scale, grouped heads,
  heads-first layout, padding) and the segment decays from `g` (`_segment_decays`, whose
  form keeps the decay gradients accurate: docs/engine.md, "Precision against float64").

Per chunk of C tokens (heads and chunks batched), with S the state entering it, D the
within-chunk decays (D_ij = exp(g_{j+1} + ... + g_i), j <= i), fs / te the decays from the chunk
start / to the chunk end, cd = fs_{C-1}:

    kb = beta k;  M = I + strict_lower((kb k^T) * D);  u = M^-1 (beta v);  w = M^-1 (fs kb)
    vn = u - w S;  S' = cd S + (te k)^T vn;  o = (fs q) S + ((q k^T) * D) vn

and the backward runs these equations in reverse (the derivations beside each step).

Legend: B batch, H value heads, N chunks, C chunk size, K key dim, V value dim; `_x` suffixes
give the trailing dims after [B, H, N].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from longstraw.ops.gated_delta_rule import (
    _check_inputs,
    _chunk_scan,
    _segment_decays,
    _to_heads_first,
    _ut_transform,
)


class KeptChunks(NamedTuple):
    """What the backward of one span reads that its forward computed with matmuls, a triangular
    solve and the sequential scan (`chunked_end_state_in_float64(..., keep=True)`), all float64
    [B, H, N, ...]: kept from the replay of the states entering the blockwise backward's blocks
    so the span's vector-Jacobian product does not compute them again."""

    kk: torch.Tensor
    """[.., C, C] (beta k) k^T."""
    inv: torch.Tensor
    """[.., C, C] M^-1."""
    u: torch.Tensor
    """[.., C, V] M^-1 (beta v)."""
    w: torch.Tensor
    """[.., C, K] M^-1 (fs beta k)."""
    starts: torch.Tensor
    """[.., K, V] the state entering each chunk."""
    v_new: torch.Tensor
    """[.., C, V] vn = u - w S."""


def _heads_first_padded(leaves, use_qk_l2norm_in_kernel, chunk_size):
    """(q, k, v, g, beta) heads-first in float64, padded to whole chunks (module legend of
    `longstraw.ops.gated_delta_rule`), and the chunk size and count."""
    T = leaves[0].shape[1]
    C = min(chunk_size, T)
    pad = (C - T % C) % C
    q, k, v, g_h, beta_h = _to_heads_first(*leaves, use_qk_l2norm_in_kernel, torch.float64)
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g_h, beta_h = (F.pad(x, (0, pad)) for x in (g_h, beta_h))
    return (q, k, v, g_h, beta_h), C, (T + pad) // C


def _kept_chunks(k_NCK, v_NCV, beta_NC1, seg, initial_state) -> tuple[KeptChunks, torch.Tensor]:
    """The UT transform and the scan of `longstraw.ops.gated_delta_rule._chunked` (the same
    functions, so the same bits) -> (the pieces, the final state)."""
    from_start_NC = seg[..., 0]
    kk_NCC, inv_NCC, u_NCV, w_NCK = _ut_transform(
        k_NCK, v_NCV, beta_NC1, seg[..., 1:], from_start_NC
    )
    state = initial_state.detach().to(torch.float64)
    starts_NKV, v_new_NCV, state = _chunk_scan(
        k_NCK, u_NCV, w_NCK, from_start_NC, seg[..., -1, 1:], state
    )
    return KeptChunks(kk_NCC, inv_NCC, u_NCV, w_NCK, starts_NKV, v_new_NCV), state


def chunked_end_state_in_float64(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, KeptChunks]:
    """The final state of `chunked_in_float64(...)` (the same bits), without its output and
    without autograd, and the pieces its vector-Jacobian product reads
    (`chunked_vjp_in_float64(..., kept=)`)."""
    _check_inputs(query, key, value, g, beta, initial_state, {})
    B, _, _, Dk = key.shape
    Hv, Dv = value.shape[2:]
    with torch.no_grad():
        leaves = [x.to(torch.float64) for x in (query, key, value, g, beta)]
        (_, k, v, g_h, beta_h), C, N = _heads_first_padded(
            leaves, use_qk_l2norm_in_kernel, chunk_size
        )
        seg = _segment_decays(g_h.view(B, Hv, N, C))
        kept, state = _kept_chunks(
            k.view(B, Hv, N, C, Dk), v.view(B, Hv, N, C, Dv), beta_h.view(B, Hv, N, C, 1), seg,
            initial_state,
        )  # fmt: skip
    return state, kept


def chunked_vjp_in_float64(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    grad_out: torch.Tensor | None,
    grad_final: torch.Tensor | None,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    kept: KeptChunks | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of <grad_out, out> + <grad_final, final state> for
    `chunked_in_float64(query, key, value, g, beta, initial_state, chunk_size, ...)` ->
    (d query, d key, d value, d g, d beta, d initial_state), float64, in the inputs' layouts
    (module legend of `longstraw.ops.gated_delta_rule`). A None cotangent is zero. `kept`: what
    `chunked_end_state_in_float64` gave for these same inputs (not computed again).
    """
    _check_inputs(query, key, value, g, beta, initial_state, {})
    B, T, _, Dk = key.shape
    Hv, Dv = value.shape[2:]
    f64 = torch.float64
    leaves = [x.detach().to(f64).requires_grad_(True) for x in (query, key, value, g, beta)]
    with torch.enable_grad():
        (q, k, v, g_h, beta_h), C, N = _heads_first_padded(
            leaves, use_qk_l2norm_in_kernel, chunk_size
        )
        seg_graph = _segment_decays(g_h.view(B, Hv, N, C))
    pad = N * C - T
    preamble = (q, k, v, beta_h)
    q_NCK, k_NCK = q.detach().view(B, Hv, N, C, Dk), k.detach().view(B, Hv, N, C, Dk)
    v_NCV = v.detach().view(B, Hv, N, C, Dv)
    beta_NC1 = beta_h.detach().view(B, Hv, N, C, 1)
    seg = seg_graph.detach()
    decay_NCC = seg[..., 1:]
    from_start_NC = seg[..., 0]
    to_end_NC = seg[..., -1, 1:]
    chunk_decay_N11 = from_start_NC[..., -1, None, None]

    # --- forward: what the backward reads (kept by the replay, or computed here) ---
    if kept is None:
        kept, _ = _kept_chunks(k_NCK, v_NCV, beta_NC1, seg, initial_state)
    kk_NCC, inv_NCC, u_NCV, w_NCK, start_NKV, vn_NCV = kept
    kb_NCK = k_NCK * beta_NC1
    k_to_end_NCK = k_NCK * to_end_NC.unsqueeze(-1)
    w_chunks, k_to_end_chunks = w_NCK.unbind(2), k_to_end_NCK.unbind(2)
    decay_chunks = chunk_decay_N11.unbind(2)

    # --- backward ---
    if grad_out is None:
        do_NCV = torch.zeros_like(vn_NCV)
    else:
        do = grad_out.detach().to(f64).transpose(1, 2)
        if pad:
            do = F.pad(do, (0, 0, 0, pad))
        do_NCV = do.reshape(B, Hv, N, C, Dv)
    d_state = (
        torch.zeros_like(start_NKV[:, :, 0])
        if grad_final is None
        else grad_final.detach().to(f64).clone()
    )
    qk_NCC = q_NCK @ k_NCK.transpose(-1, -2)
    attn_NCC = qk_NCC * decay_NCC
    q_from_start_NCK = q_NCK * from_start_NC.unsqueeze(-1)
    # o = qf S + attn vn: the parts of d vn and d S that need no later chunk, batched.
    attn_t_do_NCV = attn_NCC.transpose(-1, -2) @ do_NCV
    qf_t_do_NKV = q_from_start_NCK.transpose(-1, -2) @ do_NCV
    # Reverse scan: S' = cd S + kte^T vn and vn = u - w S carry the state's cotangent back.
    d_vn, d_end = [None] * N, [None] * N
    attn_t_do_chunks, qf_t_do_chunks = attn_t_do_NCV.unbind(2), qf_t_do_NKV.unbind(2)
    for n in reversed(range(N)):
        d_end[n] = d_state
        d_vn[n] = attn_t_do_chunks[n] + k_to_end_chunks[n] @ d_state
        d_state = (
            qf_t_do_chunks[n] + d_state * decay_chunks[n] - w_chunks[n].transpose(-1, -2) @ d_vn[n]
        )
    d_initial = d_state
    d_vn_NCV = torch.stack(d_vn, dim=2)
    d_end_NKV = torch.stack(d_end, dim=2)

    # o = (q kᵀ ⊙ D) vn + (fs q) S
    d_attn_NCC = do_NCV @ vn_NCV.transpose(-1, -2)
    d_qk_NCC = d_attn_NCC * decay_NCC
    d_decay_NCC = d_attn_NCC * qk_NCC
    do_st_NCK = do_NCV @ start_NKV.transpose(-1, -2)
    d_q_NCK = d_qk_NCC @ k_NCK + do_st_NCK * from_start_NC.unsqueeze(-1)
    d_from_start_NC = (do_st_NCK * q_NCK).sum(-1)
    d_k_NCK = d_qk_NCC.transpose(-1, -2) @ q_NCK
    # S' = cd S + kteᵀ vn
    d_chunk_decay_N = (d_end_NKV * start_NKV).sum((-1, -2))
    d_k_to_end_NCK = vn_NCV @ d_end_NKV.transpose(-1, -2)
    d_k_NCK += d_k_to_end_NCK * to_end_NC.unsqueeze(-1)
    d_to_end_NC = (d_k_to_end_NCK * k_NCK).sum(-1)
    # vn = u - w S
    d_w_NCK = -(d_vn_NCV @ start_NKV.transpose(-1, -2))
    # u = M^-1 vb, w = M^-1 kbf: d vb = M^-T du, d kbf = M^-T dw, and
    # dM = -M^-T (du vbᵀ + dw kbfᵀ) M^-T = -(d vb uᵀ + d kbf wᵀ), read on M's strict lower part
    # (the only part the unit-triangular solve reads).
    inv_t_NCC = inv_NCC.transpose(-1, -2)
    d_vb_NCV = inv_t_NCC @ d_vn_NCV
    d_kbf_NCK = inv_t_NCC @ d_w_NCK
    d_ut_NCC = -(d_vb_NCV @ u_NCV.transpose(-1, -2) + d_kbf_NCK @ w_NCK.transpose(-1, -2))
    d_ut_NCC = d_ut_NCC.tril(-1)
    # ut = (kb kᵀ) ⊙ D
    d_kk_NCC = d_ut_NCC * decay_NCC
    d_decay_NCC += d_ut_NCC * kk_NCC
    d_kb_NCK = d_kk_NCC @ k_NCK + d_kbf_NCK * from_start_NC.unsqueeze(-1)
    d_k_NCK += d_kk_NCC.transpose(-1, -2) @ kb_NCK
    d_from_start_NC += (d_kbf_NCK * kb_NCK).sum(-1)
    # vb = beta v, kb = beta k
    d_v_NCV = d_vb_NCV * beta_NC1
    d_beta_NC = (d_vb_NCV * v_NCV).sum(-1) + (d_kb_NCK * k_NCK).sum(-1)
    d_k_NCK += d_kb_NCK * beta_NC1

    # The decays are views of the segment decays: their cotangents go back there, and through
    # `_segment_decays` (autograd) into g.
    d_seg = torch.zeros_like(seg)
    d_seg[..., 1:] = d_decay_NCC
    d_seg[..., 0] += d_from_start_NC
    d_seg[..., -1, 1:] += d_to_end_NC
    d_seg[..., -1, 0] += d_chunk_decay_N
    grads = torch.autograd.grad(
        (*preamble, seg_graph),
        leaves,
        (
            d_q_NCK.view(q.shape),
            d_k_NCK.view(k.shape),
            d_v_NCV.view(v.shape),
            d_beta_NC.view(beta_h.shape),
            d_seg,
        ),
        allow_unused=True,
    )
    grads = tuple(
        torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads, strict=True)
    )
    return (*grads, d_initial)
