"""`GradBuffer`: fp32 gradient accumulators by parameter name.

The engine drains each backward into one (`longstraw.engine.group`); the optimizer
(`longstraw.grpo.optim`) steps from one. It sits in `grpo`, below the engine, so that neither
imports the other's package for it.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


class GradBuffer:
    """fp32 gradient accumulators for a model's trainable parameters, by parameter name."""

    def __init__(self, model: PreTrainedModel):
        # zeros_like keeps a sharded parameter's layout (an FSDP2 DTensor gets a DTensor buffer
        # holding only its local shard), so draining sharded gradients adds shard to shard.
        self.grads: dict[str, torch.Tensor] = {
            name: torch.zeros_like(p, dtype=torch.float32).detach()
            for name, p in model.named_parameters()
            if p.requires_grad
        }

    @classmethod
    def from_tensors(cls, grads: dict[str, torch.Tensor]) -> GradBuffer:
        """A buffer over existing fp32 tensors (a stored contribution), without copying."""
        buffer = cls.__new__(cls)
        buffer.grads = dict(grads)
        return buffer

    def add_(self, other: GradBuffer) -> GradBuffer:
        for name, grad in other.grads.items():
            self.grads[name] += grad
        return self

    def into_param_grads(self, model: PreTrainedModel) -> None:
        """Add these gradients to each parameter's `.grad` (cast to the parameter's dtype)."""
        for name, p in model.named_parameters():
            if name in self.grads:
                grad = self.grads[name].to(p.dtype)
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad.add_(grad)
