"""Attention for decoding from a frozen prefix: Q new queries, N branch keys (N >= Q), T prefix keys.

Legend: B rows (samples), H query heads, K kv heads, G = H // K, Q new queries, N branch keys so far
(the last Q of which belong to the new queries), T prefix keys, D / V head dims, M = B * G * Q
query rows that read one prefix kv head, X = G * Q query rows of one row's kv head.

Rollout samples G responses in one batch from one shared prefix; each step's queries attend to all
prefix keys and, bottom-right aligned, to the branch keys up to their own position. No autograd:
this path only generates.

The prefix has no batch dimension, so every row's queries of kv head k read the same keys: all
M = B * G * Q of them are folded into ONE query block [K, M, D] and the prefix is read once per
layer per step, a fixed chunk of keys at a time: one call of PyTorch's fused CPU flash kernel
(which returns the log-sum-exp) per chunk, over a [1, K, C, D] view of the [C, K, D] rows of the
state (no copy), the chunks merged by log-sum-exp in order. The rows' own keys (a view of the
layer's preallocated branch buffer) are a second, branch-sized partial; the two merge by
log-sum-exp. On CUDA with flash-attn installed (bf16/fp16) flash-attn takes the CPU kernel's place
(`longstraw.ops.dispatch`; not yet run on a GPU). Where no fused kernel applies (other devices or
dtypes, V != D) the prefix partial is the same folded block against prefix chunks, one bmm per
chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor

from longstraw.ops import dispatch
from longstraw.ops.partial_attention import (
    flash_prefix_partial,
    merge_partial_attention,
    merge_partials,
)
from longstraw.ops.prefix_attention import PrefixRanks, _prefix_partial

# Prefix keys per chunk (default): [K, M, 4096] fp32 scores at most on the fallback path.
_PREFIX_CHUNK = 4096


def _prefix_kernel(q: Tensor, k_prefix_TKD: Tensor, v_prefix_TKV: Tensor) -> str:
    """The kernel of the prefix partial (`longstraw.ops.dispatch`): a fused one (CPU flash, or
    flash-attn on CUDA) or LongStraw's bmm per chunk."""
    return dispatch.attention_kernel(
        q.device, q.dtype, k_prefix_TKD.shape[-1], v_prefix_TKV.shape[-1],
        (k_prefix_TKD.dtype, v_prefix_TKV.dtype),
    )  # fmt: skip


def _prefix_partial_folded(
    q_KMD: Tensor, k_prefix_TKD: Tensor, v_prefix_TKV: Tensor, scale: float, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """(out [K, M, V] fp32, lse [K, M] fp32) of M query rows per kv head over all T keys,
    `chunk_size` prefix keys at a time (one fused call per chunk, LSE-merged in order); T = 0
    (a rank holding no positions): out 0, lse -inf."""
    if k_prefix_TKD.shape[0] == 0:
        dtype = torch.promote_types(q_KMD.dtype, torch.float32)
        rows = q_KMD.shape[:2]
        return (
            q_KMD.new_zeros((*rows, v_prefix_TKV.shape[-1]), dtype=dtype),
            q_KMD.new_full(rows, float("-inf"), dtype=dtype),
        )
    kernel = _prefix_kernel(q_KMD, k_prefix_TKD, v_prefix_TKV)
    if kernel != dispatch.TORCH:
        out, lse = flash_prefix_partial(
            q_KMD.unsqueeze(0), k_prefix_TKD, v_prefix_TKV, scale, chunk_size, kernel=kernel,
            site="full_attention.decode",
        )  # fmt: skip
        return out[0], lse[0]
    dispatch.ran("full_attention.decode", dispatch.TORCH)
    dtype = torch.promote_types(q_KMD.dtype, torch.float32)
    return _prefix_partial(q_KMD.to(dtype) * scale, k_prefix_TKD, v_prefix_TKV, chunk_size)


def _branch_partial(q_BKXD: Tensor, k_BKND: Tensor, v_BKNV: Tensor, q_len: int, scale: float):
    """(out [B, K, X, V], lse [B, K, X]) fp32 over the rows' own keys, bottom-right causal."""
    dtype = torch.promote_types(q_BKXD.dtype, torch.float32)
    n = k_BKND.shape[2]
    scores_BKXN = (q_BKXD.to(dtype) @ k_BKND.to(dtype).transpose(-1, -2)).mul_(scale)
    if q_len > 1:
        # Query j (of Q) sits at branch position N - Q + j and sees keys 0 .. N - Q + j.
        own_X = (n - q_len + torch.arange(q_len, device=q_BKXD.device)).repeat(
            q_BKXD.shape[2] // q_len
        )
        hidden_XN = torch.arange(n, device=q_BKXD.device)[None, :] > own_X[:, None]
        scores_BKXN.masked_fill_(hidden_XN, float("-inf"))
    lse_BKX = torch.logsumexp(scores_BKXN, dim=-1)
    probs_BKXN = scores_BKXN.sub_(lse_BKX[..., None]).exp_()
    return probs_BKXN @ v_BKNV.to(dtype), lse_BKX


@torch.no_grad()
def decode_attention(
    q_BHQD: Tensor,
    k_branch_BKND: Tensor,
    v_branch_BKNV: Tensor,
    k_prefix_TKD: Tensor,
    v_prefix_TKV: Tensor,
    *,
    scale: float,
    chunk_size: int = _PREFIX_CHUNK,
    ranks: PrefixRanks | None = None,
) -> Tensor:
    """out_BHQV of the Q newest branch queries over [prefix ; branch[: own position + 1]].

    The branch K/V may be strided views (the layer's preallocated buffer); the prefix is read
    in place, once, whatever B, `chunk_size` keys at a time (the same grid the replay's prefix
    attention uses, so a streamed state can hand it one chunk at a time). `ranks` (replicated:
    every rank decodes the same step) as in `prefix_cached_attention`: the prefix is this rank's
    part of the prompt's, the partials of all parts are merged in rank order.
    """
    b, h, q_len, d = q_BHQD.shape
    k_heads, n = k_branch_BKND.shape[1], k_branch_BKND.shape[2]
    if n < q_len:
        raise ValueError(f"branch keys ({n}) must include the {q_len} new queries' own keys")
    groups = h // k_heads
    value_dim = v_branch_BKNV.shape[-1]
    q_BKXD = q_BHQD.reshape(b, k_heads, groups * q_len, d)
    out_BKXV, lse_BKX = _branch_partial(q_BKXD, k_branch_BKND, v_branch_BKNV, q_len, scale)
    if k_prefix_TKD.shape[0] > 0 or ranks is not None:
        # Rows in (B, G, Q) order per kv head: one query block that reads the prefix once.
        q_KMD = q_BKXD.transpose(0, 1).reshape(k_heads, b * groups * q_len, d)
        out_KMV, lse_KM = _prefix_partial_folded(
            q_KMD, k_prefix_TKD, v_prefix_TKV, scale, chunk_size
        )
        if ranks is not None:
            outs, lses = zip(*ranks.gather(out_KMV, lse_KM), strict=True)
            out_KMV, lse_KM = merge_partials(list(outs), list(lses))
        out_BKXV, lse_BKX = merge_partial_attention(
            out_KMV.view(k_heads, b, -1, value_dim).transpose(0, 1),
            lse_KM.view(k_heads, b, -1).transpose(0, 1),
            out_BKXV,
            lse_BKX,
        )
    return out_BKXV.reshape(b, h, q_len, value_dim).to(q_BHQD.dtype)


def naive_decode_attention(
    q_BHQD: Tensor,
    k_branch_BKND: Tensor,
    v_branch_BKNV: Tensor,
    k_prefix_TKD: Tensor,
    v_prefix_TKV: Tensor,
    *,
    scale: float,
) -> Tensor:
    """Reference: concatenate, materialise the masked score matrix, softmax in fp32."""
    b, h, q_len, _ = q_BHQD.shape
    k_heads, n = k_branch_BKND.shape[1], k_branch_BKND.shape[2]
    t = k_prefix_TKD.shape[0]
    groups = h // k_heads
    prefix_k = k_prefix_TKD.permute(1, 0, 2).unsqueeze(0).expand(b, -1, -1, -1)
    prefix_v = v_prefix_TKV.permute(1, 0, 2).unsqueeze(0).expand(b, -1, -1, -1)
    keys = torch.cat([prefix_k, k_branch_BKND], dim=2).repeat_interleave(groups, dim=1).float()
    values = torch.cat([prefix_v, v_branch_BKNV], dim=2).repeat_interleave(groups, dim=1).float()
    scores = (q_BHQD.float() @ keys.transpose(-1, -2)) * scale
    key_pos = torch.arange(t + n)
    query_pos = t + n - q_len + torch.arange(q_len)
    scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    return (torch.softmax(scores, -1) @ values).to(q_BHQD.dtype)
