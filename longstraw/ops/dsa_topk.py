"""DSA top-k selection with a fixed tie rule: among equal scores the earlier position wins.

Shape legend: B batch rows, S queries, T candidate key positions (prefix + branch, in position
order), k the indexer's `index_topk`.

`torch.topk` breaks ties differently at different lengths (docs/design.md: random GLM models produce
many exactly-zero index scores, and a full forward and a cached forward then select different
positions). LongStraw selects what a *stable* descending sort selects: the k largest scores,
ties resolved toward the smaller position. Prefill, replay and the exact sweep all use this
rule, so a shard recomputed in the sweep selects exactly what prefill selected.

The result is a boolean keep-mask [B, S, T] rather than indices: the attention reads it chunk by
chunk beside the keys. Masked-out candidates carry -inf; they only get selected when a row has
fewer than k finite scores, and then every finite candidate is selected as well.
"""

import torch
from torch import Tensor


def stable_topk_mask(scores_BST: Tensor, k: int) -> Tensor:
    """[B, S, T] bool: True at the k largest scores of each row, ties to the earlier position.

    O(S * T) besides one `torch.topk` for the k-th largest value: every score above the k-th value
    is kept, and of the scores equal to it, the earliest ones fill the remaining places.
    """
    if k <= 0:
        raise ValueError(f"index_topk must be >= 1, got {k}")
    num = scores_BST.shape[-1]
    if k >= num:
        return torch.ones(scores_BST.shape, dtype=torch.bool, device=scores_BST.device)
    kth_BS1 = scores_BST.topk(k, dim=-1).values[..., -1:]
    above_BST = scores_BST > kth_BS1
    ties_BST = scores_BST == kth_BS1
    room_BS1 = k - above_BST.sum(dim=-1, keepdim=True)
    # cumsum over the tie indicator ranks equal scores by position; keep the first `room` of them.
    return above_BST | (ties_BST & (ties_BST.cumsum(dim=-1) <= room_BS1))


def naive_stable_topk_mask(scores_BST: Tensor, k: int) -> Tensor:
    """Reference: the first k entries of a stable descending sort of each row."""
    num = scores_BST.shape[-1]
    order_BST = torch.sort(scores_BST, dim=-1, descending=True, stable=True).indices
    keep_BST = torch.zeros(scores_BST.shape, dtype=torch.bool, device=scores_BST.device)
    return keep_BST.scatter(-1, order_BST[..., : min(k, num)], True)


def stable_topk_indices(scores_BST: Tensor, k: int) -> Tensor:
    """[B, S, min(k, T)] int64 positions a stable descending sort puts first (ties to earlier)."""
    order_BST = torch.sort(scores_BST, dim=-1, descending=True, stable=True).indices
    return order_BST[..., : min(k, scores_BST.shape[-1])]


def global_topk(candidates_BSC2: Tensor, k: int) -> Tensor:
    """[B, S, k] int64 ascending positions: the k best of C candidates (score, position) — each
    part's own top-k of a split set of positions — by (score descending, position ascending).
    The top-k of a union under a total order is the top-k of the union of each part's top-k, so
    this is `stable_topk_mask` of all positions."""
    by_position = candidates_BSC2[..., 1].argsort(dim=-1, stable=True)
    scores_BSC = candidates_BSC2[..., 0].gather(-1, by_position)
    positions_BSC = candidates_BSC2[..., 1].gather(-1, by_position)
    best_BSK = stable_topk_indices(scores_BSC, k)
    return positions_BSC.gather(-1, best_BSK).sort(dim=-1).values.long()
