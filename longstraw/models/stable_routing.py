"""MoE expert selection with ties broken toward the earlier expert index, as issue 11.4 requires.

`torch.topk` does not specify which of equal scores it returns, and its choice can differ
between a long prefill shard and a one-token branch. Inside the engine, Qwen3-Next's router
selects with a stable descending sort instead: the same experts as `torch.topk` whenever scores
are distinct (the usual case), and the earlier index on exact ties, in prefill, replay and sweep
alike. GLM-5's router is handled in `longstraw.models.glm` (see docs/glm.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


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


_ROUTER_FORWARDS = {"Qwen3NextTopKRouter": _qwen3_next_router_forward}


@contextlib.contextmanager
def stable_routing_installed(model: nn.Module) -> Iterator[None]:
    """Route every known MoE router of `model` through its stable-top-k forward in the block."""
    patched = []
    for module in model.modules():
        forward = _ROUTER_FORWARDS.get(type(module).__name__)
        if forward is not None:
            module.forward = forward.__get__(module)
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
