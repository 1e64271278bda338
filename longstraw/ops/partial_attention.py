"""Partial softmax attentions as (out, lse), their FlashAttention-2 backward, and the N-way merge.

Legend: B batch rows, H query heads, K kv heads (G = H // K), R query rows (branch or shard),
T prefix keys held by this rank, D head dim, V value dim, N = G * R rows of one kv head,
C keys of one chunk. Queries arrive PRE-SCALED (q * scale) and in the compute dtype (fp32), so
every rank computes scores the same way and dq is returned w.r.t. the scaled query.

Sequence-sharded attention splits the keys of one softmax across ranks: each rank computes the
attention of the same queries over its own keys, normalised over those keys only, and the log of
its normaliser (lse). `merge_partials` combines them exactly. The backward needs only the GLOBAL
out and lse: with P_j = exp(s_j - lse) and delta = rowsum(dO * O),
    dV_j = P_j^T dO,  dS_j = P_j * (dO v_j^T - delta),  dK_j = dS_j^T q,  dq = sum_j dS_j k_j,
so a rank computes its keys' dK/dV and its share of dq without seeing any other rank's keys.
The prefix keys are read chunk by chunk and never copied whole.
"""

from __future__ import annotations

import torch
from torch import Tensor

from longstraw.ops import dispatch


def _rows(x_BHRX: Tensor, num_kv_heads: int) -> Tensor:
    """[B, H, R, X] -> [B, K, G * R, X]: the query rows that read one kv head, as one matrix."""
    batch, num_heads, length, dim = x_BHRX.shape
    return x_BHRX.reshape(batch, num_kv_heads, (num_heads // num_kv_heads) * length, dim)


def _chunk(x_TKX: Tensor, start: int, end: int, dtype: torch.dtype) -> Tensor:
    """Keys [start, end) as [K, C, X] in `dtype` (a copy of one chunk at most)."""
    return x_TKX[start:end].to(dtype).transpose(0, 1)


def prefix_partial(
    q_BHRD: Tensor, k_TKD: Tensor, v_TKV: Tensor, *, chunk_size: int = 1024
) -> tuple[Tensor, Tensor]:
    """Attention of (pre-scaled) queries over all T prefix keys: (out [B,H,R,V], lse [B,H,R]).

    T = 0 gives out = 0 and lse = -inf (a partial with no keys; the merge ignores it).
    A fused kernel computes it when one applies (`longstraw.ops.dispatch`: PyTorch's CPU flash
    kernel on CPU, flash-attn on CUDA), one call per `chunk_size` keys merged in order
    (`flash_prefix_partial`), else the chunked online softmax below. Either way the keys are read on the fixed grid of
    `chunk_size` rows, so a streamed prefix (`longstraw.engine.state_tiers.StreamedRows`) gives
    the resident result bit for bit. Every rank takes the same branch for the same inputs, so
    replicated ranks still agree bit for bit.
    """
    if k_TKD.shape[0] > 0 and _flash_applies(q_BHRD, k_TKD, v_TKV):
        return flash_prefix_partial(q_BHRD, k_TKD, v_TKV, 1.0, chunk_size)
    if k_TKD.shape[0] > 0:  # an empty partial (a rank without positions) runs no kernel
        dispatch.ran("full_attention.prefix", dispatch.TORCH)
    return _chunked_partial(q_BHRD, k_TKD, v_TKV, chunk_size)


# The fused kernel returns the log-sum-exp beside the output: the chunked loop materialises a
# [rows, 1024] score matrix per chunk and took 2.5x the time of the whole single-process
# attention at P = 8K. Measured 4.7x faster than the chunked loop at T=8192, R=1024 (fp32, 2 cores).
_CPU_FLASH = dispatch.CPU_FLASH


def _kernel(q_BHRD: Tensor, k_TKD: Tensor, v_TKV: Tensor, *, gpu: bool = True) -> str:
    return dispatch.attention_kernel(
        q_BHRD.device, q_BHRD.dtype, k_TKD.shape[-1], v_TKV.shape[-1], (k_TKD.dtype, v_TKV.dtype),
        gpu=gpu,
    )  # fmt: skip


def _flash_applies(q_BHRD: Tensor, k_TKD: Tensor, v_TKV: Tensor) -> bool:
    """A fused kernel computes the prefix partial of these inputs (see `longstraw.ops.dispatch`)."""
    return _kernel(q_BHRD, k_TKD, v_TKV) != dispatch.TORCH


def flash_prefix_partial(
    q_BXRD: Tensor,
    k_prefix_TKD,
    v_prefix_TKD,
    scale: float,
    chunk_size: int,
    *,
    site: str = "full_attention.prefix",
) -> tuple[Tensor, Tensor]:
    """(out [B, X, R, V] fp32, lse [B, X, R] fp32) of queries over all T > 0 prefix keys: one
    fused call per `chunk_size` keys, merged first to last — PyTorch's CPU flash kernel on CPU,
    flash-attn on CUDA (`longstraw.ops.dispatch.attention_kernel`; the caller checked that one
    applies). The prefix is anything that slices into [C, K, D] tensors (a tensor, or a streamed
    state's rows). `site` names the caller in the kernel log."""
    batch = q_BXRD.shape[0]
    kernel = dispatch.attention_kernel(
        q_BXRD.device, q_BXRD.dtype, k_prefix_TKD.shape[-1], v_prefix_TKD.shape[-1],
        (k_prefix_TKD.dtype, v_prefix_TKD.dtype),
    )  # fmt: skip
    on_gpu = kernel == dispatch.FLASH_ATTN
    dispatch.ran(site, dispatch.FLASH_ATTN if on_gpu else dispatch.ATEN_CPU_FLASH)
    out = lse = None
    for start in range(0, k_prefix_TKD.shape[0], chunk_size):
        if on_gpu:
            out_c, lse_c = dispatch.flash_attn_partial(
                q_BXRD,
                k_prefix_TKD[start : start + chunk_size],
                v_prefix_TKD[start : start + chunk_size],
                scale,
            )
        else:
            k_p = k_prefix_TKD[start : start + chunk_size].permute(1, 0, 2).unsqueeze(0)
            v_p = v_prefix_TKD[start : start + chunk_size].permute(1, 0, 2).unsqueeze(0)
            k_p, v_p = k_p.expand(batch, -1, -1, -1), v_p.expand(batch, -1, -1, -1)
            out_c, lse_c = _CPU_FLASH(q_BXRD, k_p, v_p, 0.0, False, attn_mask=None, scale=scale)[:2]
            out_c, lse_c = out_c.float(), lse_c.float()
        if out is None:
            out, lse = out_c, lse_c
        else:
            out, lse = merge_partial_attention(out, lse, out_c, lse_c)
    return out, lse


def _chunked_partial(
    q_BHRD: Tensor, k_TKD: Tensor, v_TKV: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """prefix_partial as an online softmax over chunks of `chunk_size` keys."""
    batch, num_heads, length, _ = q_BHRD.shape
    num_kv_heads, value_dim = k_TKD.shape[1], v_TKV.shape[-1]
    dtype = q_BHRD.dtype
    q_BKND = _rows(q_BHRD, num_kv_heads)
    rows = q_BKND.shape[:-1]
    max_BKN = q_BHRD.new_full(rows, float("-inf"))
    sum_BKN = q_BHRD.new_zeros(rows)
    acc_BKNV = q_BHRD.new_zeros((*rows, value_dim))
    for start in range(0, k_TKD.shape[0], chunk_size):
        end = min(start + chunk_size, k_TKD.shape[0])
        scores_BKNC = q_BKND @ _chunk(k_TKD, start, end, dtype).transpose(-1, -2)
        new_max_BKN = torch.maximum(max_BKN, scores_BKNC.amax(dim=-1))
        rescale_BKN = torch.exp(max_BKN - new_max_BKN)
        probs_BKNC = scores_BKNC.sub_(new_max_BKN[..., None]).exp_()
        sum_BKN = sum_BKN * rescale_BKN + probs_BKNC.sum(dim=-1)
        acc_BKNV = acc_BKNV * rescale_BKN[..., None] + probs_BKNC @ _chunk(v_TKV, start, end, dtype)
        max_BKN = new_max_BKN
    if k_TKD.shape[0] == 0:
        out_BKNV, lse_BKN = acc_BKNV, max_BKN
    else:
        out_BKNV, lse_BKN = acc_BKNV / sum_BKN[..., None], max_BKN + torch.log(sum_BKN)
    return (
        out_BKNV.reshape(batch, num_heads, length, value_dim),
        lse_BKN.reshape(batch, num_heads, length),
    )


def prefix_partial_backward(
    q_BHRD: Tensor,
    grad_out_BHRV: Tensor,
    lse_BHR: Tensor,
    delta_BHR: Tensor,
    k_TKD: Tensor,
    v_TKV: Tensor,
    *,
    chunk_size: int = 1024,
    grad_k_TKD: Tensor | None = None,
    grad_v_TKV: Tensor | None = None,
) -> Tensor:
    """This rank's share of dq (w.r.t. the scaled query) from its prefix keys, given the GLOBAL
    lse and delta; ADDS the prefix dK/dV (summed over batch rows and grouped heads) into the
    fp32 buffers when given."""
    num_kv_heads = k_TKD.shape[1]
    dtype = q_BHRD.dtype
    q_BKND = _rows(q_BHRD, num_kv_heads)
    grad_out_BKNV = _rows(grad_out_BHRV, num_kv_heads)
    lse_BKN1 = _rows(lse_BHR[..., None], num_kv_heads)
    delta_BKN1 = _rows(delta_BHR[..., None], num_kv_heads)
    grad_q_BKND = torch.zeros_like(q_BKND)
    for start in range(0, k_TKD.shape[0], chunk_size):
        end = min(start + chunk_size, k_TKD.shape[0])
        k_KCD = _chunk(k_TKD, start, end, dtype)
        v_KCV = _chunk(v_TKV, start, end, dtype)
        probs_BKNC = (q_BKND @ k_KCD.transpose(-1, -2)).sub_(lse_BKN1).exp_()
        grad_scores_BKNC = (grad_out_BKNV @ v_KCV.transpose(-1, -2)).sub_(delta_BKN1)
        grad_scores_BKNC.mul_(probs_BKNC)
        grad_q_BKND += grad_scores_BKNC @ k_KCD
        if grad_v_TKV is not None:
            grad_v_KCV = (probs_BKNC.transpose(-1, -2) @ grad_out_BKNV).sum(dim=0)
            grad_v_TKV[start:end] += grad_v_KCV.transpose(0, 1)
        if grad_k_TKD is not None:
            grad_k_KCD = (grad_scores_BKNC.transpose(-1, -2) @ q_BKND).sum(dim=0)
            grad_k_TKD[start:end] += grad_k_KCD.transpose(0, 1)
    return grad_q_BKND.reshape(q_BHRD.shape)


def _per_query_head(x_BKRX: Tensor, num_heads: int) -> Tensor:
    """Branch K/V [B, K, R, X] -> [B, H, R, X] (branch-sized copy; the branch is short)."""
    return x_BKRX.repeat_interleave(num_heads // x_BKRX.shape[1], dim=1)


def _causal_scores(q_BHRD: Tensor, k_BHXD: Tensor) -> Tensor:
    """[B, H, R, X] scores, bottom-right aligned: query i sits at key position X - R + i and sees
    keys 0 .. X - R + i (X = R: the plain causal mask; X > R: decoding over a kept overlay)."""
    length, num_keys = q_BHRD.shape[2], k_BHXD.shape[2]
    hidden_RX = torch.ones(length, num_keys, dtype=torch.bool, device=q_BHRD.device).triu_(
        num_keys - length + 1
    )
    return (q_BHRD @ k_BHXD.transpose(-1, -2)).masked_fill_(hidden_RX, float("-inf"))


def causal_partial(q_BHRD: Tensor, k_BKXD: Tensor, v_BKXV: Tensor) -> tuple[Tensor, Tensor]:
    """Causal attention of (pre-scaled) queries over the branch's own keys: (out, lse).

    X >= R branch keys, the queries being the last R of them (X > R when decoding over a kept
    overlay; the backward below covers X = R only: decoding runs without autograd).
    The fused CPU flash kernel computes it when X = R (its causal mask is top-left aligned) and
    it applies (see prefix_partial); otherwise [B, H, R, X] scores are materialised: R and X are
    a branch or a prefill shard, not the prompt.
    """
    dtype = q_BHRD.dtype
    num_heads = q_BHRD.shape[1]
    if k_BKXD.shape[2] < q_BHRD.shape[2]:
        raise ValueError(
            f"branch keys ({k_BKXD.shape[2]}) must include the {q_BHRD.shape[2]} queries' own keys"
        )
    fused = _kernel(q_BHRD, k_BKXD, v_BKXV, gpu=False) == dispatch.ATEN_CPU_FLASH
    if k_BKXD.shape[2] == q_BHRD.shape[2] and fused:
        dispatch.ran("full_attention.branch", dispatch.ATEN_CPU_FLASH)
        out, lse = _CPU_FLASH(q_BHRD, k_BKXD, v_BKXV, 0.0, True, attn_mask=None, scale=1.0)[:2]
        return out, lse
    dispatch.ran("full_attention.branch", dispatch.TORCH)
    scores_BHRX = _causal_scores(q_BHRD, _per_query_head(k_BKXD.to(dtype), num_heads))
    lse_BHR = torch.logsumexp(scores_BHRX, dim=-1)
    probs_BHRX = (scores_BHRX - lse_BHR[..., None]).exp_()
    return probs_BHRX @ _per_query_head(v_BKXV.to(dtype), num_heads), lse_BHR


def causal_partial_backward(
    q_BHRD: Tensor,
    k_BKRD: Tensor,
    v_BKRV: Tensor,
    grad_out_BHRV: Tensor,
    lse_BHR: Tensor,
    delta_BHR: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq w.r.t. the scaled query, dk [B,K,R,D], dv [B,K,R,V]) of the causal branch part."""
    batch, num_heads, length, _ = q_BHRD.shape
    num_kv_heads = k_BKRD.shape[1]
    dtype = q_BHRD.dtype
    k_BHRD = _per_query_head(k_BKRD.to(dtype), num_heads)
    v_BHRV = _per_query_head(v_BKRV.to(dtype), num_heads)
    probs_BHRR = _causal_scores(q_BHRD, k_BHRD).sub_(lse_BHR[..., None]).exp_()
    grad_scores_BHRR = (grad_out_BHRV @ v_BHRV.transpose(-1, -2)).sub_(delta_BHR[..., None])
    grad_scores_BHRR.mul_(probs_BHRR)
    grad_q_BHRD = grad_scores_BHRR @ k_BHRD
    grad_k_BHRD = grad_scores_BHRR.transpose(-1, -2) @ q_BHRD
    grad_v_BHRV = probs_BHRR.transpose(-1, -2) @ grad_out_BHRV

    def per_kv_head(x_BHRX: Tensor) -> Tensor:
        return x_BHRX.reshape(batch, num_kv_heads, num_heads // num_kv_heads, length, -1).sum(2)

    return grad_q_BHRD, per_kv_head(grad_k_BHRD), per_kv_head(grad_v_BHRV)


def merge_partials(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Exact softmax over the union of disjoint key sets from per-set (out, lse): the one
    log-sum-exp merge of LongStraw, for a prefix and a branch on one process and for the
    partials of several ranks alike. Returns (out, lse); any leading shape, fp32 or wider.

    Each partial is normalised over its own keys; lse = -inf marks a partial with no keys (its
    out is ignored: it may hold garbage, and 0 * NaN is NaN). At least one partial must have
    keys for every row. The weights come from the global lse, so an empty partial anywhere in
    the list leaves the bits unchanged; fixed order: the same inputs give the same bits.
    """
    lse_NBHR = torch.stack(lses)
    lse_BHR = torch.logsumexp(lse_NBHR, dim=0)
    weight_NBHR1 = torch.exp(lse_NBHR - lse_BHR)[..., None]
    out_NBHRV = torch.where(weight_NBHR1 > 0, weight_NBHR1 * torch.stack(outs), 0.0)
    return out_NBHRV.sum(dim=0), lse_BHR


def merge_partial_attention(
    out_a_BHRV: Tensor, lse_a_BHR: Tensor, out_b_BHRV: Tensor, lse_b_BHR: Tensor
) -> tuple[Tensor, Tensor]:
    """`merge_partials` of two partials (out, lse): (out, lse)."""
    return merge_partials([out_a_BHRV, out_b_BHRV], [lse_a_BHR, lse_b_BHR])


def naive_partial(
    q_BHRD: Tensor, k_BKSD: Tensor, v_BKSV: Tensor, visible_RS: Tensor
) -> tuple[Tensor, Tensor]:
    """Reference: materialised attention of scaled queries over keys where `visible_RS`."""
    num_heads = q_BHRD.shape[1]
    scores = q_BHRD @ _per_query_head(k_BKSD, num_heads).transpose(-1, -2)
    scores = scores.masked_fill(~visible_RS, float("-inf"))
    lse_BHR = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse_BHR[..., None]).nan_to_num(0.0)
    return probs @ _per_query_head(v_BKSV, num_heads), lse_BHR
