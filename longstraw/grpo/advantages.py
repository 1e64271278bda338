"""Group-relative advantages and reward-function weighting, as TRL 1.16's GRPOTrainer does them.

Legend: N samples, G generations per group, F reward functions; rewards_NF are laid out group by
group (samples 0..G-1 are group 0), as TRL lays them out.

TRL: rewards = nansum_f(w_f * r_nf); A = (r - mean_group(r)) / (std + 1e-4) with std the unbiased
std within each group ("group") or over the whole batch ("batch"), and no division for "none".

One deliberate difference: a group whose rewards are all equal gets exactly zero advantages. TRL
computes r - mean in float arithmetic, which for equal rewards such as 0.1 can leave a rounding
residue (~1e-8) that the 1e-4 denominator then amplifies to a spurious ~1e-4 advantage.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

# TRL adds 1e-4 to the std so that a zero-variance group divides by 1e-4, not 0.
_STD_EPSILON = 1e-4

ScaleRewards = Literal["group", "batch", "none"]


def _as_rewards_tensor(rewards: Tensor | Sequence[float] | Sequence[Sequence[float]]) -> Tensor:
    # Python numbers become float64 (torch's default float32 would round them before we start).
    if not isinstance(rewards, Tensor):
        return torch.as_tensor(rewards, dtype=torch.float64)
    return rewards if rewards.is_floating_point() else rewards.to(torch.float64)


def weighted_rewards(
    rewards_per_func_NF: Tensor | Sequence[Sequence[float]],
    reward_weights_F: Sequence[float] | Tensor | None = None,
) -> Tensor:
    """[N] total reward: sum over reward functions of weight * reward, NaN treated as absent.

    As TRL: `(rewards_per_func * weights).nansum(dim=1)`, so a function that returned None (NaN)
    for a sample is left out of that sample's sum; a sample where every function is NaN gets 0
    and a warning (TRL warns too). Infinite rewards raise ValueError naming the sample.
    """
    r = _as_rewards_tensor(rewards_per_func_NF)
    if r.dim() != 2:
        raise ValueError(f"rewards_per_func_NF must be [N, F], got shape {tuple(r.shape)}")
    num_f = r.shape[1]
    w = (
        torch.ones(num_f, dtype=r.dtype)
        if reward_weights_F is None
        else torch.as_tensor(reward_weights_F, dtype=r.dtype)
    )
    if w.shape != (num_f,):
        raise ValueError(
            f"got {w.numel()} reward weights for {num_f} reward functions; give one weight per function"
        )
    inf = torch.isinf(r)
    if inf.any():
        n, f = (int(i) for i in inf.nonzero()[0])
        raise ValueError(
            f"reward of sample {n} from reward function {f} is {float(r[n, f])}; rewards must be finite"
        )
    all_nan = torch.isnan(r).all(dim=1)
    if all_nan.any():
        warnings.warn(
            f"every reward function returned NaN/None for samples {all_nan.nonzero().flatten().tolist()}; "
            "their reward is 0 (as TRL)",
            stacklevel=2,
        )
    return (r * w.unsqueeze(0)).nansum(dim=1)


def group_advantages(
    rewards: Tensor | Sequence[float] | Sequence[Sequence[float]],
    scale_rewards: ScaleRewards = "group",
) -> Tensor:
    """Advantages of `rewards` ([G] for one group or [num_groups, G]), same shape.

    Mean per group; divided by (std + 1e-4) with the unbiased std per group ("group") or over all
    rewards ("batch"), not divided for "none". Computed in float64, returned in the input's
    floating dtype (float64 for Python numbers). All-equal groups give exactly 0; non-finite
    rewards raise ValueError naming the sample.
    """
    if isinstance(scale_rewards, bool):  # TRL's former boolean values
        scale_rewards = "group" if scale_rewards else "none"
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    r_in = _as_rewards_tensor(rewards)
    if r_in.dim() not in (1, 2) or r_in.numel() == 0:
        raise ValueError(
            f"rewards must be [G] or [num_groups, G] and non-empty, got shape {tuple(r_in.shape)}"
        )
    bad = ~torch.isfinite(r_in)
    if bad.any():
        flat = int(bad.flatten().nonzero()[0])
        g = r_in.shape[-1]
        where = f"sample {flat}" + (
            f" (group {flat // g}, generation {flat % g})" if r_in.dim() == 2 else ""
        )
        raise ValueError(
            f"reward of {where} is {float(r_in.flatten()[flat])}; rewards must be finite "
            "(check the reward function for that sample)"
        )
    r_BG = r_in.to(torch.float64).reshape(-1, r_in.shape[-1])
    num_g = r_BG.shape[1]

    centred = r_BG - r_BG.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        # TRL: std of a single generation is taken as 0 (torch.std would give NaN).
        std = r_BG.std(dim=1, keepdim=True) if num_g > 1 else torch.zeros_like(r_BG[:, :1])
        adv = centred / (std + _STD_EPSILON)
    elif scale_rewards == "batch":
        std = r_BG.std() if r_BG.numel() > 1 else torch.zeros((), dtype=r_BG.dtype)
        adv = centred / (std + _STD_EPSILON)
    else:
        adv = centred
    equal = (r_BG == r_BG[:, :1]).all(dim=1, keepdim=True)
    adv = torch.where(equal, torch.zeros_like(adv), adv)
    return adv.reshape(r_in.shape).to(r_in.dtype)
