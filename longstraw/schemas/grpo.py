"""GRPOConfig: the user's GRPO knobs, named as TRL 1.16's `GRPOConfig` names them.

A field that means the same thing as a TRL field carries TRL's name and TRL's default, so a TRL
config translates key for key. Optimiser fields use the transformers 5 `TrainingArguments` names
(`adam_beta1`, `warmup_steps`, ...). No torch here: schemas are plain contracts.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceSamplingLevel = Literal["token", "sequence"]


class GRPOConfig(BaseModel):
    """GRPO objective, sampling and optimiser settings for one training run."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    # --- group and objective -------------------------------------------------------------------
    num_generations: int = Field(default=8, ge=2)
    """G: responses sampled per prompt. At least 2: advantages are relative within a group."""

    loss_type: LossType = "dapo"
    """How the masked per-token loss is reduced (TRL 1.16 semantics, default "dapo" as TRL):
    "grpo" mean over each sequence's tokens then over sequences; "bnpo" sum / tokens in the local
    batch; "dr_grpo" sum / (sequences * max_completion_length); "dapo" sum / completion tokens in
    the whole step (`num_items_in_batch`)."""

    epsilon: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Lower clip: the ratio is clipped below at 1 - epsilon."""

    epsilon_high: float | None = Field(default=None, ge=0.0)
    """Upper clip: the ratio is clipped above at 1 + epsilon_high. None means equal to `epsilon`;
    DAPO recommends 0.28."""

    delta: float | None = Field(default=None)
    """Two-sided GRPO (INTELLECT-2): upper clamp of the unclipped ratio term. None disables it;
    it should exceed 1 + epsilon_high."""

    beta: float = Field(default=0.0, ge=0.0)
    """KL coefficient (k3 estimator against the reference model). 0 loads no reference model."""

    importance_sampling_level: ImportanceSamplingLevel = "token"
    """"token": one ratio per token; "sequence" (GSPO): one ratio per sequence, the exp of the
    mean log-ratio over its unmasked tokens."""

    scale_rewards: ScaleRewards = "group"
    """Advantage scaling: "group" divides by the std within each group, "batch" by the std over
    the whole batch, "none" only centres. TRL's booleans are accepted: True -> "group",
    False -> "none"."""

    reward_weights: list[float] | None = None
    """[F] weight of each reward function, in the order the reward specs are given. None weighs
    every function 1.0."""

    mask_truncated_completions: bool = False
    """Exclude completions that hit `max_completion_length` without an end token from the loss."""

    vllm_importance_sampling_correction: bool = True
    """For responses generated elsewhere (`sampler_logprobs` given): multiply each token's loss by
    the truncated importance weight min(exp(logp_old - logp_sampler), cap), correcting the
    sampler/trainer mismatch as TRL does for vLLM rollouts (TIS). No effect on LongStraw's own
    rollouts, whose sampler log-probs are the trainer's."""

    vllm_importance_sampling_cap: float = Field(default=2.0, gt=0.0)
    """Truncation cap of that importance weight (TRL's default 2.0)."""

    num_iterations: int = Field(default=1, ge=1)
    """Optimiser updates per rollout (mu in the GRPO paper). With 1 the old log-probs equal the
    current ones and need not be computed."""

    # --- sampling ------------------------------------------------------------------------------
    max_completion_length: int = Field(default=256, ge=1)
    """Maximum response length in tokens; also the constant normaliser of "dr_grpo"."""

    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature; log-probs for the loss are computed at the same temperature."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass in (0, 1]; 1.0 keeps every token."""

    top_k: int | None = Field(default=None, ge=1)
    """Keep only the k most likely tokens when sampling; None disables top-k filtering."""

    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    """Minimum token probability relative to the most likely token, in [0, 1]; None disables it."""

    # --- optimiser (transformers TrainingArguments names) --------------------------------------
    learning_rate: float = Field(default=1e-6, gt=0.0)
    """AdamW learning rate (TRL's GRPO default 1e-6)."""

    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW decoupled weight decay."""

    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    """AdamW first-moment decay."""

    adam_beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    """AdamW second-moment decay."""

    adam_epsilon: float = Field(default=1e-8, gt=0.0)
    """AdamW denominator epsilon."""

    max_grad_norm: float = Field(default=1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables clipping (as transformers)."""

    warmup_steps: float = Field(default=0, ge=0.0)
    """Linear warm-up as transformers 5 defines it: an integer >= 1 is a number of steps, a float
    in [0, 1) a fraction of the total steps (transformers 5 folded `warmup_ratio` into this)."""

    # --- validators ----------------------------------------------------------------------------
    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_rewards_from_bool(cls, value: Any) -> Any:
        # TRL 1.16 still accepts its former boolean values.
        if isinstance(value, bool):
            return "group" if value else "none"
        return value

    @field_validator("reward_weights")
    @classmethod
    def _finite_reward_weights(cls, value: list[float] | None) -> list[float] | None:
        if value is None:
            return value
        if not value:
            raise ValueError(
                "reward_weights is an empty list; give one weight per reward function or leave it unset"
            )
        for i, w in enumerate(value):
            if not math.isfinite(w):
                raise ValueError(
                    f"reward_weights[{i}] is {w}; every weight must be a finite number"
                )
        return value

    @field_validator("warmup_steps")
    @classmethod
    def _warmup_steps_is_count_or_ratio(cls, value: float) -> float:
        if value >= 1 and value != int(value):
            raise ValueError(
                f"warmup_steps={value} is neither a whole number of steps nor a ratio in [0, 1); "
                f"use {int(value)} steps or a fraction such as 0.1"
            )
        return value

    @model_validator(mode="after")
    def _clip_bounds_are_ordered(self) -> GRPOConfig:
        eps_high = self.effective_epsilon_high
        if eps_high < self.epsilon:
            raise ValueError(
                f"epsilon_high must be >= epsilon (got {eps_high} < {self.epsilon}); set epsilon_high "
                "to at least epsilon or leave it unset"
            )
        if self.delta is not None and self.delta <= 1.0:
            raise ValueError(
                f"delta must be > 1 (got {self.delta}): it caps the unclipped ratio, and a cap at or "
                f"below 1 would clip on-policy tokens; use a value above 1 + epsilon_high "
                f"(> {1 + eps_high}) or leave it unset"
            )
        return self

    @property
    def effective_epsilon_high(self) -> float:
        """The upper clip epsilon in force: `epsilon_high`, or `epsilon` when unset (as TRL)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
