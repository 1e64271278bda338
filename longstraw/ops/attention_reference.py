"""Slow, obvious reference for prefix-cached attention: concatenate, materialise, softmax.

Shape legend:
    B batch rows, H query heads, K kv heads (H % K == 0), R branch length,
    T prefix length, D query/key head dim, V value head dim (may differ from D).
    Value tensors keep the `_BKRD`/`_TKD` suffix of the public API; their last dim is V.

Every branch query sees all T prefix positions and the branch keys causally (query i sees
branch keys 0..i). This is the semantics `prefix_cached_attention` must reproduce; it is
written for clarity, not memory: it copies the prefix into every batch row and builds the
full [R, T + R] score matrix per head.
"""

import torch
from torch import Tensor


def repeat_kv(x_BKLX: Tensor, num_groups: int) -> Tensor:
    """[B, K, L, X] -> [B, K * num_groups, L, X]; query head h uses kv head h // num_groups.

    Same layout as transformers' `repeat_kv`, so GQA heads pair up exactly as in the models.
    """
    batch, num_kv_heads, length, dim = x_BKLX.shape
    x_BKGLX = x_BKLX[:, :, None].expand(batch, num_kv_heads, num_groups, length, dim)
    return x_BKGLX.reshape(batch, num_kv_heads * num_groups, length, dim)


def naive_prefix_attention(
    q_BHRD: Tensor,
    k_branch_BKRD: Tensor,
    v_branch_BKRD: Tensor,
    k_prefix_TKD: Tensor,
    v_prefix_TKD: Tensor,
    *,
    scale: float,
) -> Tensor:
    """Softmax attention of branch queries over [prefix ; branch] keys; returns out_BHRV in q's dtype.

    Scores, softmax and the weighted sum are computed in fp32 (fp64 stays fp64). Gradients
    reach the prefix tensors through plain autograd when they require grad.
    """
    batch, num_heads, branch_len, _ = q_BHRD.shape
    num_kv_heads = k_branch_BKRD.shape[1]
    prefix_len = k_prefix_TKD.shape[0]
    compute_dtype = torch.promote_types(q_BHRD.dtype, torch.float32)

    # The prefix has no batch dim: every row attends to the same prompt state.
    k_prefix_BKTD = k_prefix_TKD.permute(1, 0, 2)[None].expand(batch, -1, -1, -1)
    v_prefix_BKTV = v_prefix_TKD.permute(1, 0, 2)[None].expand(batch, -1, -1, -1)
    k_BKLD = torch.cat([k_prefix_BKTD.to(compute_dtype), k_branch_BKRD.to(compute_dtype)], dim=2)
    v_BKLV = torch.cat([v_prefix_BKTV.to(compute_dtype), v_branch_BKRD.to(compute_dtype)], dim=2)
    k_BHLD = repeat_kv(k_BKLD, num_heads // num_kv_heads)
    v_BHLV = repeat_kv(v_BKLV, num_heads // num_kv_heads)

    scores_BHRL = (q_BHRD.to(compute_dtype) @ k_BHLD.transpose(-1, -2)) * scale
    query_pos_R = torch.arange(branch_len, device=q_BHRD.device)
    key_pos_L = torch.arange(prefix_len + branch_len, device=q_BHRD.device) - prefix_len
    # Prefix keys have negative branch positions, so "key_pos <= query_pos" keeps all of them.
    visible_RL = key_pos_L[None, :] <= query_pos_R[:, None]
    scores_BHRL = scores_BHRL.masked_fill(~visible_RL, float("-inf"))
    probs_BHRL = torch.softmax(scores_BHRL, dim=-1)
    return (probs_BHRL @ v_BHLV).to(q_BHRD.dtype)
