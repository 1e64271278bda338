"""MoE expert selection with ties broken toward the earlier expert index.

`torch.topk` does not specify which of equal scores it returns, and its choice can differ
between a long prefill shard and a one-token branch. Inside the engine, Qwen3-Next's router
selects with a stable descending sort instead: the same experts as `torch.topk` whenever scores
are distinct (the usual case), and the earlier index on exact ties, in prefill, replay and sweep
alike. GLM-5's group-limited router gets the same treatment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from longstraw.models.patching import forwards_replaced


def stable_topk(scores: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries; equal entries keep index order."""
    values, indices = torch.sort(scores, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


def _qwen3_next_router_forward(self, hidden_states: torch.Tensor):
    """Qwen3NextTopKRouter.forward (transformers 5.24) with `stable_topk` for the selection."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = stable_topk(router_probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    return router_logits, router_top_value, router_indices


def _glm_moe_dsa_router_forward(self, hidden_states: torch.Tensor):
    """GlmMoeDsaTopkRouter.forward (transformers 5.24: sigmoid scores, correction bias, group-limited
    selection) with `stable_topk` for the group and expert choices."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    per_group = self.num_experts // self.num_group
    group_scores = stable_topk(scores_for_choice.view(-1, self.num_group, per_group), 2)[0].sum(-1)
    group_idx = stable_topk(group_scores, self.topk_group)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
    )
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = stable_topk(scores_for_choice, self.top_k)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


_ROUTER_FORWARDS = {
    "Qwen3NextTopKRouter": _qwen3_next_router_forward,
    "GlmMoeDsaTopkRouter": _glm_moe_dsa_router_forward,
}


@contextlib.contextmanager
def stable_routing_installed(model: nn.Module) -> Iterator[None]:
    """Route every known MoE router of `model` through its stable-top-k forward in the block."""
    # Nested use (layer recomputation inside the engine) restores the outer block's.
    routers = [
        (module, _ROUTER_FORWARDS[type(module).__name__])
        for module in model.modules()
        if type(module).__name__ in _ROUTER_FORWARDS
    ]
    with forwards_replaced(routers):
        yield
