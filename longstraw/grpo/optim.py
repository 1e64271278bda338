"""The optimizer step: AdamW on fp32 master weights, grad-norm clipping, linear warm-up.

Gradients arrive as an fp32 `GradBuffer` (the sum of the step's group contributions). A bf16
model keeps fp32 master copies inside this class: AdamW updates on bf16 weights lose most small
steps to rounding. For an fp32 model the parameters are their own masters (no copy).

With the weights sharded at rest over ranks (FSDP2, `PolicyOptimizer.over_local_shards`) each
rank steps only its rows: the tensors it updates are the local shards of the parameters, its
gradients the matching rows, its AdamW state and masters 1/N of the whole, and the clipping norm
is summed over the ranks first (AdamW itself is elementwise, so the rows step independently).

The learning rate rises linearly over `warmup_steps` (TRL/transformers semantics: an int of
steps, or a fraction in [0, 1) of the run's steps) and then stays constant — RL post-training
runs are open-ended, so no decay schedule is assumed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from longstraw.grpo.grad_buffer import GradBuffer
from longstraw.schemas.grpo import GRPOConfig


@dataclass(frozen=True)
class UpdateStats:
    grad_norm: float
    """Global L2 norm of the fp32 gradient before clipping."""
    learning_rate: float
    clipped: bool


def warmup_factor(step: int, warmup_steps: float, num_steps: int) -> float:
    """LR multiplier at optimizer step `step` (0-based)."""
    warm = warmup_steps * num_steps if 0 < warmup_steps < 1 else warmup_steps
    warm = math.ceil(warm)
    if warm <= 0:
        return 1.0
    return min(1.0, (step + 1) / warm)


class PolicyOptimizer:
    """AdamW over a model's trainable parameters, fed from fp32 gradient buffers."""

    def __init__(self, model: PreTrainedModel, cfg: GRPOConfig, *, num_steps: int):
        self.model = model
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self._setup(named, cfg, num_steps=num_steps, sum_over_ranks=None)

    @classmethod
    def over_local_shards(
        cls,
        named: list[tuple[str, torch.Tensor]],
        cfg: GRPOConfig,
        *,
        num_steps: int,
        sum_over_ranks: Callable[[torch.Tensor], torch.Tensor],
    ) -> PolicyOptimizer:
        """An optimizer over this rank's shards of the parameters (`named`: [(name, local
        tensor)], each a view that writes through to the sharded parameter's storage);
        `sum_over_ranks` sums a float64 scalar tensor over the ranks (the clipping norm)."""
        self = cls.__new__(cls)
        self.model = None
        self._setup(named, cfg, num_steps=num_steps, sum_over_ranks=sum_over_ranks)
        return self

    def _setup(self, named, cfg: GRPOConfig, *, num_steps: int, sum_over_ranks) -> None:
        self.cfg = cfg
        self.num_steps = num_steps
        self.sum_over_ranks = sum_over_ranks
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        # fp32 models train their own parameters; anything else trains fp32 masters.
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
            for p in self.params
        ]
        # Decay by the parameter's rank, not its shard's: a shard of a matrix is still a matrix.
        decay = [m for m, p in zip(self.masters, self.params, strict=True) if p.dim() >= 2]
        no_decay = [m for m, p in zip(self.masters, self.params, strict=True) if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                # Norm weights and biases are not decayed (transformers' Trainer convention).
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_epsilon,
        )
        self.step_count = 0

    def _grad_norm(self, tensors: list[torch.Tensor]) -> float:
        if self.sum_over_ranks is None:
            norms = [torch.linalg.vector_norm(g) for g in tensors]
            return float(torch.linalg.vector_norm(torch.stack(norms)))
        squares = sum(
            (torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in tensors),
            torch.zeros((), dtype=torch.float64),
        )
        return float(self.sum_over_ranks(squares.cpu()).sqrt())

    def apply(self, grads: GradBuffer) -> UpdateStats:
        """One optimizer step from `grads`; clips, warms up, copies masters back to the model."""
        tensors = [grads.grads[name] for name in self.names]
        norm_value = self._grad_norm(tensors)
        if not math.isfinite(norm_value):
            raise FloatingPointError(
                f"gradient norm is {norm_value} at optimizer step {self.step_count}: refusing to "
                "update; check the rewards and the learning rate"
            )
        clip = self.cfg.max_grad_norm > 0 and norm_value > self.cfg.max_grad_norm
        scale = self.cfg.max_grad_norm / (norm_value + 1e-6) if clip else 1.0
        lr = self.cfg.learning_rate * warmup_factor(
            self.step_count, self.cfg.warmup_steps, self.num_steps
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for master, grad in zip(self.masters, tensors, strict=True):
            master.grad = grad * scale if clip else grad.clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                if master is not param:
                    param.copy_(master)
        self.step_count += 1
        return UpdateStats(grad_norm=norm_value, learning_rate=lr, clipped=clip)

    # --- persistence (safetensors-compatible flat dicts; no pickle) ---------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Flat {key: tensor} of the optimizer state and fp32 masters, for safetensors."""
        out: dict[str, torch.Tensor] = {}
        state = self.optimizer.state
        for name, master, param in zip(self.names, self.masters, self.params, strict=True):
            for key, value in state.get(master, {}).items():
                out[f"{key}/{name}"] = (
                    value.detach().reshape(-1) if value.dim() == 0 else value.detach()
                )
            if master is not param:
                out[f"master/{name}"] = master.detach()
        out["meta/step_count"] = torch.tensor([self.step_count], dtype=torch.int64)
        return {key: value.contiguous().cpu() for key, value in out.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what `state_tensors` wrote (the model's weights are loaded separately)."""
        self.step_count = int(tensors["meta/step_count"][0])
        for name, master, param in zip(self.names, self.masters, self.params, strict=True):
            if master is not param and f"master/{name}" in tensors:
                with torch.no_grad():
                    master.copy_(tensors[f"master/{name}"])
            entry = {}
            for key in ("step", "exp_avg", "exp_avg_sq"):
                value = tensors.get(f"{key}/{name}")
                if value is not None:
                    entry[key] = value.reshape(()) if key == "step" else value.to(master.device)
            if entry:
                self.optimizer.state[master] = entry
