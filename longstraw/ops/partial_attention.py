"""Partial softmax attentions as (out, lse): the fused kernels' prefix partial and the one merge.

Legend: B batch rows, H (or X) query heads, K kv heads, R query rows (branch or shard), T prefix
keys, C keys of one chunk, D head dim, V value dim.

An attention over several disjoint key sets (a prefix and a branch; a prompt split over the
ranks that hold it; the chunks of one prefix) is computed as one partial per set, each
normalised over its own keys with the log of its normaliser (lse), and `merge_partials`
combines them exactly. The backward needs only the GLOBAL out and lse: with
P_j = exp(s_j - lse) and delta = rowsum(dO * O),
    dV_j = P_j^T dO,  dS_j = P_j * (dO v_j^T - delta),  dK_j = dS_j^T q,  dq = sum_j dS_j k_j,
so each key set's dK/dV and share of dq come without seeing any other set's keys
(`longstraw.ops.prefix_attention`, `longstraw.ops.mla_attention`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from longstraw.ops import dispatch

# PyTorch's CPU flash kernel returns the log-sum-exp beside the output: measured 4.7x faster than
# LongStraw's chunked loop at T=8192, R=1024 (fp32, 2 cores).
_CPU_FLASH = dispatch.CPU_FLASH


def flash_prefix_partial(
    q_BXRD: Tensor,
    k_prefix_TKD,
    v_prefix_TKD,
    scale: float,
    chunk_size: int,
    *,
    kernel: str,
    site: str = "full_attention.prefix",
) -> tuple[Tensor, Tensor]:
    """(out [B, X, R, V] fp32, lse [B, X, R] fp32) of queries over all T > 0 prefix keys: one
    fused call per `chunk_size` keys, merged first to last — by `kernel`, the fused kernel the
    caller's `longstraw.ops.dispatch.attention_kernel` chose: PyTorch's CPU flash kernel on
    CPU, flash-attn on CUDA. The prefix is anything that slices into [C, K, D] tensors (a
    tensor, or a streamed state's rows). `site` names the caller in the kernel log."""
    batch = q_BXRD.shape[0]
    on_gpu = kernel == dispatch.FLASH_ATTN
    dispatch.ran(site, kernel)
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


def _per_query_head(x_BKRX: Tensor, num_heads: int) -> Tensor:
    """Branch K/V [B, K, R, X] -> [B, H, R, X] (a copy; the reference only)."""
    return x_BKRX.repeat_interleave(num_heads // x_BKRX.shape[1], dim=1)


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
