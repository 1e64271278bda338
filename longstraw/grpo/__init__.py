"""GRPO math independent of models: advantages, the loss registry, reward functions."""

from longstraw.grpo.advantages import group_advantages, weighted_rewards
from longstraw.grpo.losses import (
    LOSSES,
    BranchStats,
    LossFn,
    LossStats,
    branch_loss,
    clipped_surrogate_objective,
    get_loss,
    group_loss,
    loss_mask,
    reduce_stats,
    register_loss,
    sequence_weights,
)
from longstraw.grpo.rewards import (
    RewardFn,
    get_reward,
    register_reward,
    reward_names,
    score_group,
    score_group_per_func,
)

__all__ = [
    "LOSSES",
    "BranchStats",
    "LossFn",
    "LossStats",
    "RewardFn",
    "branch_loss",
    "clipped_surrogate_objective",
    "get_loss",
    "get_reward",
    "group_advantages",
    "group_loss",
    "loss_mask",
    "reduce_stats",
    "register_loss",
    "register_reward",
    "reward_names",
    "score_group",
    "score_group_per_func",
    "sequence_weights",
    "weighted_rewards",
]
