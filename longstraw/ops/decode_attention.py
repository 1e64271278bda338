"""Attention for decoding from a frozen prefix: Q new queries, N branch keys (N >= Q), T prefix keys.

Legend: B rows (samples), H query heads, K kv heads, G = H // K, Q new queries, N branch keys so far
(the last Q of which belong to the new queries), T prefix keys, D / V head dims.

Rollout samples G responses in one batch from one shared prefix; each step's queries attend to all
prefix keys and, bottom-right aligned, to the branch keys up to their own position. No autograd:
this path only generates. The prefix is read in chunks with an online softmax, so no [Q, T]
score matrix exists at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Prefix keys per chunk: [B, H, Q, 8192] fp32 scores at most per step.
_PREFIX_CHUNK = 8192


@torch.no_grad()
def decode_attention(
    q_BHQD: Tensor,
    k_branch_BKND: Tensor,
    v_branch_BKNV: Tensor,
    k_prefix_TKD: Tensor,
    v_prefix_TKV: Tensor,
    *,
    scale: float,
) -> Tensor:
    """out_BHQV of the Q newest branch queries over [prefix ; branch[: own position + 1]]."""
    b, h, q_len, _ = q_BHQD.shape
    k_heads, n = k_branch_BKND.shape[1], k_branch_BKND.shape[2]
    if n < q_len:
        raise ValueError(f"branch keys ({n}) must include the {q_len} new queries' own keys")
    groups = h // k_heads
    q = q_BHQD.float().reshape(b, k_heads, groups * q_len, -1) * scale  # [B, K, G*Q, D]

    # Branch part: query j sits at branch position n - q_len + j.
    scores_BKXN = q @ k_branch_BKND.float().transpose(-1, -2)
    positions = torch.arange(n, device=q.device)
    own = (n - q_len + torch.arange(q_len, device=q.device)).repeat(groups)  # [G*Q]
    scores_BKXN = scores_BKXN.masked_fill(positions[None, :] > own[:, None], float("-inf"))
    running_max = scores_BKXN.amax(-1, keepdim=True)
    weights = torch.exp(scores_BKXN - running_max)
    running_sum = weights.sum(-1, keepdim=True)
    acc = weights @ v_branch_BKNV.float()

    for start in range(0, k_prefix_TKD.shape[0], _PREFIX_CHUNK):
        k_chunk = k_prefix_TKD[start : start + _PREFIX_CHUNK].float().permute(1, 2, 0)  # [K, D, C]
        v_chunk = v_prefix_TKV[start : start + _PREFIX_CHUNK].float().transpose(0, 1)  # [K, C, V]
        scores = q @ k_chunk  # [B, K, G*Q, C]
        chunk_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
        correction = torch.exp(running_max - chunk_max)
        weights = torch.exp(scores - chunk_max)
        running_sum = running_sum * correction + weights.sum(-1, keepdim=True)
        acc = acc * correction + weights @ v_chunk
        running_max = chunk_max

    out = (acc / running_sum).reshape(b, h, q_len, -1)
    return out.to(q_BHQD.dtype)


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
