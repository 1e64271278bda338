"""Group-relative advantages and reward weighting against hand-computed values and a loop."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from longstraw.grpo.advantages import group_advantages, weighted_rewards

EPS = 1e-4  # TRL's std epsilon


def naive_advantages(rewards_BG: list[list[float]], scale_rewards: str) -> list[list[float]]:
    """TRL's formula as a plain loop with the statistics module (sample std, Bessel)."""
    flat = [r for row in rewards_BG for r in row]
    out = []
    for row in rewards_BG:
        mean = statistics.fmean(row)
        if scale_rewards == "group":
            denom = statistics.stdev(row) + EPS
        elif scale_rewards == "batch":
            denom = statistics.stdev(flat) + EPS
        else:
            denom = 1.0
        out.append([(r - mean) / denom for r in row])
    return out


def test_group_scaling_matches_hand_computed_value():
    # mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], "group")
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    assert torch.allclose(adv, torch.tensor([a, -a, -a, a], dtype=torch.float64), rtol=1e-15)


def test_batch_scaling_uses_group_means_and_the_batch_std():
    # group means 1 and 5; std of [0, 1, 2, 4, 5, 6]: mean 3, squares 9+4+1+1+4+9 = 28, /5 = 5.6
    adv = group_advantages([[0.0, 1.0, 2.0], [4.0, 5.0, 6.0]], "batch")
    d = math.sqrt(5.6) + EPS
    expected = torch.tensor([[-1 / d, 0.0, 1 / d], [-1 / d, 0.0, 1 / d]], dtype=torch.float64)
    assert torch.allclose(adv, expected, rtol=1e-15), (adv, expected)


def test_none_scaling_only_centres():
    adv = group_advantages([[0.0, 1.0, 5.0], [2.0, 2.0, 8.0]], "none")
    expected = torch.tensor([[-2.0, -1.0, 3.0], [-2.0, -2.0, 4.0]], dtype=torch.float64)
    assert torch.equal(adv, expected), adv


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_match_naive_loop(scale_rewards):
    rng = random.Random(42)
    rewards = [[rng.uniform(-2, 3) for _ in range(7)] for _ in range(5)]
    got = group_advantages(rewards, scale_rewards)
    expected = torch.tensor(naive_advantages(rewards, scale_rewards), dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=1e-12, atol=1e-14), (got - expected).abs().max()


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_all_equal_group_gives_exact_zero_advantages_not_nan(scale_rewards):
    # 0.1 * 3 is not exactly representable: a plain r - mean can leave a rounding residue.
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.0, 1.0, 0.3]], dtype=torch.float32)
    adv = group_advantages(rewards, scale_rewards)
    assert adv.dtype == torch.float32
    assert torch.isfinite(adv).all()
    assert (adv[0] == 0).all(), adv[0]
    assert (adv[1] != 0).all()


def test_single_group_of_identical_rewards_is_all_zero():
    adv = group_advantages([1.0] * 8, "group")
    assert adv.tolist() == [0.0] * 8


def test_bool_scale_rewards_is_accepted_as_trl_does():
    r = [[0.0, 1.0, 3.0]]
    assert torch.equal(group_advantages(r, True), group_advantages(r, "group"))
    assert torch.equal(group_advantages(r, False), group_advantages(r, "none"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_reward_raises_naming_the_sample(bad):
    with pytest.raises(ValueError, match=r"sample 4 \(group 1, generation 1\)"):
        group_advantages([[0.0, 1.0, 2.0], [3.0, bad, 5.0]], "group")
    with pytest.raises(ValueError, match="sample 2"):
        group_advantages([0.0, 1.0, bad], "none")


def test_unknown_scale_rewards_says_the_choices():
    with pytest.raises(ValueError, match="'group', 'batch' or 'none'"):
        group_advantages([0.0, 1.0], "std")


def test_weighted_rewards_is_a_nansum_of_weighted_functions():
    # row 0: 0.5*1 + 2*2 = 4.5; row 1: function 0 returned None (NaN) -> 2*3 = 6
    r = [[1.0, 2.0], [float("nan"), 3.0]]
    got = weighted_rewards(r, [0.5, 2.0])
    assert got.tolist() == [4.5, 6.0]
    assert weighted_rewards([[1.0, 2.0]]).tolist() == [3.0]  # unweighted: all 1.0


def test_weighted_rewards_all_nan_row_is_zero_with_a_warning():
    with pytest.warns(UserWarning, match=r"samples \[1\]"):
        got = weighted_rewards([[1.0, 1.0], [float("nan"), float("nan")]], [1.0, 1.0])
    assert got.tolist() == [2.0, 0.0]


def test_weighted_rewards_rejects_infinite_rewards_and_wrong_weight_count():
    with pytest.raises(ValueError, match="sample 1 from reward function 0"):
        weighted_rewards([[1.0, 1.0], [float("inf"), 1.0]])
    with pytest.raises(ValueError, match="3 reward weights for 2 reward functions"):
        weighted_rewards([[1.0, 1.0]], [1.0, 1.0, 1.0])
