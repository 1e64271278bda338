"""GRPO losses: hand-computed cases, per-branch sum vs TRL's batched formula, gradients.

Legend: G sequences, T padded completion positions.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from longstraw.grpo.losses import (
    LOSSES,
    branch_loss,
    get_loss,
    group_loss,
    loss_mask,
    reduce_stats,
    register_loss,
    sequence_weights,
)
from longstraw.schemas.grpo import GRPOConfig

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a - b).abs()
    return f"max_diff={d.max().item():.3e} mean_diff={d.mean().item():.3e}"


# --- hand-computed cases -----------------------------------------------------------------------
# Two sequences, T = 3, the second has 2 tokens. Log-ratios chosen so that the ratios are round:
#   seq 0 (A = +1): ratios 1.0, 1.5, 0.5     seq 1 (A = -1): ratios 1.1, 0.7, (pad)
# With epsilon = 0.2: clip(ratio) = 1.0, 1.2, 0.8 | 1.1, 0.8.
#   seq 0 per-token loss -min(r, c)       = -1.0, -1.2, -0.5  (sum -2.7)
#   seq 1 per-token loss -min(-r, -c)     =  1.1,  0.8        (sum  1.9)
HAND_LOGP = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -7.0]]
HAND_LOG_RATIO = [[0.0, math.log(1.5), math.log(0.5)], [math.log(1.1), math.log(0.7), 0.0]]
HAND_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
HAND_ADV = [1.0, -1.0]


def _hand_batch(dtype=torch.float64):
    logp = torch.tensor(HAND_LOGP, dtype=dtype, requires_grad=True)
    old = (logp - torch.tensor(HAND_LOG_RATIO, dtype=dtype)).detach()
    return logp, old, torch.tensor(HAND_ADV, dtype=dtype), torch.tensor(HAND_MASK, dtype=dtype)


def _branches_sum(logp, old, adv, mask, cfg, ref=None, num_items_in_batch=None):
    """Sum of branch_loss over the rows of a padded batch, each row cut to its true length."""
    lengths = mask.sum(-1)
    w = sequence_weights(cfg.loss_type, lengths, cfg, num_items_in_batch=num_items_in_batch)
    total, stats = 0.0, []
    for i in range(logp.shape[0]):
        loss_i, s = branch_loss(
            logp[i], old[i], adv[i], w[i], cfg, None if ref is None else ref[i], mask[i]
        )
        total = total + loss_i
        stats.append(s)
    return total, reduce_stats(stats)


@pytest.mark.parametrize(
    ("loss_type", "expected", "num_items"),
    [
        ("grpo", (-2.7 / 3 + 1.9 / 2) / 2, None),  # mean per sequence, then over sequences: 0.025
        ("bnpo", (-2.7 + 1.9) / 5, None),  # sum / 5 tokens: -0.16
        ("dr_grpo", (-2.7 + 1.9) / (2 * 4), None),  # sum / (2 sequences * max_completion_length 4)
        ("dapo", (-2.7 + 1.9) / 5, None),  # sum / local tokens by default
        ("dapo", (-2.7 + 1.9) / 10, 10),  # sum / global num_items_in_batch
    ],
)
def test_each_loss_type_matches_hand_computed_value(loss_type, expected, num_items):
    cfg = GRPOConfig(loss_type=loss_type, max_completion_length=4)
    logp, old, adv, mask = _hand_batch()
    ref_loss, ref_stats = group_loss(logp, old, adv, mask, cfg, num_items_in_batch=num_items)
    br_loss, br_stats = _branches_sum(logp, old, adv, mask, cfg, num_items_in_batch=num_items)
    assert abs(ref_loss.item() - expected) < 1e-12, (ref_loss.item(), expected)
    assert abs(br_loss.item() - expected) < 1e-12, (br_loss.item(), expected)
    # One token of each kind clipped out of 5: 0.7 < 0.8 with A < 0, 1.5 > 1.2 with A > 0.
    for stats in (ref_stats, br_stats):
        assert stats.kl is None
        assert stats.clip_ratio_low == pytest.approx(1 / 5)
        assert stats.clip_ratio_high == pytest.approx(1 / 5)
        assert stats.clip_ratio_region == pytest.approx(2 / 5)


def test_grpo_gradient_matches_hand_computed_value():
    # d(-min(r A, c A))/dlogp = -r A where the unclipped term is the min, 0 where clipping wins.
    # Weights 1/(3*2) and 1/(2*2). Clipped tokens: seq 0 token 1 (1.5), seq 1 token 1 (0.7).
    expected = torch.tensor(
        [[-1.0 / 6, 0.0, -0.5 / 6], [1.1 / 4, 0.0, 0.0]],
        dtype=torch.float64,
    )
    cfg = GRPOConfig(loss_type="grpo")
    logp, old, adv, mask = _hand_batch()
    (g_ref,) = torch.autograd.grad(group_loss(logp, old, adv, mask, cfg)[0], logp)
    (g_br,) = torch.autograd.grad(_branches_sum(logp, old, adv, mask, cfg)[0], logp)
    assert torch.allclose(g_ref, expected, atol=1e-12), _diff(g_ref, expected)
    assert torch.allclose(g_br, expected, atol=1e-12), _diff(g_br, expected)


def test_asymmetric_epsilon_high_clips_at_its_own_bound():
    # epsilon_high = 0.28: seq 0 token 1 (ratio 1.5, A = +1) is now clipped at 1.28.
    cfg = GRPOConfig(loss_type="bnpo", epsilon_high=0.28)
    logp, old, adv, mask = _hand_batch()
    expected = (-(1.0 + 1.28 + 0.5) + (1.1 + 0.8)) / 5
    for loss, _ in (
        group_loss(logp, old, adv, mask, cfg),
        _branches_sum(logp, old, adv, mask, cfg),
    ):
        assert abs(loss.item() - expected) < 1e-12, (loss.item(), expected)


def test_delta_caps_the_unclipped_ratio_for_negative_advantages():
    # Seq 1 (A = -1) with log-ratio ln 1.5 at token 0: without delta -min(-1.5, -1.2) = 1.5;
    # delta = 1.3 caps the unclipped ratio: -min(-1.3, -1.2) = 1.3.
    logp, old, adv, mask = _hand_batch()
    old = old.clone()
    old[1, 0] = logp[1, 0].detach() - math.log(1.5)
    for delta, tok0 in ((None, 1.5), (1.3, 1.3)):
        cfg = GRPOConfig(loss_type="bnpo", delta=delta)
        expected = (-2.7 + tok0 + 0.8) / 5
        for loss, _ in (
            group_loss(logp, old, adv, mask, cfg),
            _branches_sum(logp, old, adv, mask, cfg),
        ):
            assert abs(loss.item() - expected) < 1e-12, (delta, loss.item(), expected)


def test_sequence_level_ratio_is_exp_of_mean_log_ratio():
    # GSPO: seq 0 ratio (1 * 1.5 * 0.5)^(1/3) = 0.75^(1/3), seq 1 ratio (1.1 * 0.7)^(1/2); both inside
    # [0.8, 1.2] except seq 1 = 0.8775 (inside). Per-token loss -r*A on every token.
    r0, r1 = 0.75 ** (1 / 3), 0.77**0.5
    cfg = GRPOConfig(loss_type="grpo", importance_sampling_level="sequence")
    logp, old, adv, mask = _hand_batch()
    expected = (-r0 + r1) / 2
    for loss, stats in (
        group_loss(logp, old, adv, mask, cfg),
        _branches_sum(logp, old, adv, mask, cfg),
    ):
        assert abs(loss.item() - expected) < 1e-12, (loss.item(), expected)
        assert stats.clip_ratio_region == 0.0


def test_kl_term_is_beta_times_k3_per_token():
    # ref - logp = ln 2 on every token: k3 = 2 - ln 2 - 1. Seq 0 only (A = 0, so no policy term).
    k3 = 2.0 - math.log(2.0) - 1.0
    cfg = GRPOConfig(loss_type="grpo", beta=0.04)
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = logp.detach() + math.log(2.0)
    mask = torch.ones(1, 3, dtype=torch.float64)
    adv = torch.zeros(1, dtype=torch.float64)
    loss, stats = group_loss(logp, None, adv, mask, cfg, ref)
    assert abs(loss.item() - 0.04 * k3) < 1e-12
    assert stats.kl == pytest.approx(k3)
    # d k3 / d logp = -exp(ref - logp) + 1 = -1 per token; mean over 3 tokens, times beta.
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(g, torch.full_like(g, 0.04 * -1.0 / 3), atol=1e-12), g


# --- per-branch sum == batched, values and gradients -------------------------------------------


def _random_batch(lengths, dtype, seed=42, holes=True):
    """Padded batch with unequal lengths, masked holes inside sequences, some clipped ratios."""
    gen = torch.Generator().manual_seed(seed)
    g, t = len(lengths), max(lengths)
    mask = torch.zeros(g, t, dtype=dtype)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
        if holes and n >= 4:
            mask[i, 1] = 0.0  # e.g. a tool-output token inside the response
            mask[i, n - 2] = 0.0
    logp = -3.0 * torch.rand(g, t, generator=gen, dtype=dtype)
    # Per-token and per-sequence log-ratio noise: tokens and whole sequences get clipped, and
    # some ratios exceed delta = 1.5 with a negative advantage.
    old = (
        logp
        + 0.4 * torch.randn(g, t, generator=gen, dtype=dtype)
        + 0.25 * torch.randn(g, 1, generator=gen, dtype=dtype)
    )
    ref = logp + 0.2 * torch.randn(g, t, generator=gen, dtype=dtype)
    adv = torch.randn(g, generator=gen, dtype=dtype)
    return logp, old, ref, adv, mask


def _per_branch_grads(logp, old, ref, adv, mask, lengths, cfg, num_items=None):
    """Replays each row as its own leaf (cut to its length) and scatters the gradients back."""
    w = sequence_weights(cfg.loss_type, mask.sum(-1), cfg, num_items_in_batch=num_items)
    grad = torch.zeros_like(logp)
    total = torch.zeros((), dtype=logp.dtype)
    stats = []
    for i, n in enumerate(lengths):
        leaf = logp[i, :n].detach().clone().requires_grad_(True)
        loss_i, s = branch_loss(leaf, old[i, :n], adv[i], w[i], cfg, ref[i, :n], mask[i, :n])
        (g_i,) = torch.autograd.grad(loss_i, leaf)
        grad[i, :n] = g_i
        total = total + loss_i.detach()
        stats.append(s)
    return total, grad, reduce_stats(stats)


CASES = list(
    itertools.product(LOSS_TYPES, [0.0, 0.04], ["token", "sequence"], [None, 0.28], [None, 1.5])
)


@pytest.mark.parametrize(("loss_type", "beta", "level", "eps_high", "delta"), CASES)
def test_branch_gradients_sum_to_batched_gradient(loss_type, beta, level, eps_high, delta):
    lengths = [7, 13, 1, 10, 4]
    cfg = GRPOConfig(
        loss_type=loss_type,
        beta=beta,
        importance_sampling_level=level,
        epsilon_high=eps_high,
        delta=delta,
        max_completion_length=16,
        num_generations=len(lengths),
    )
    logp, old, ref, adv, mask = _random_batch(lengths, torch.float64)
    leaf = logp.clone().requires_grad_(True)
    ref_loss, ref_stats = group_loss(leaf, old, adv, mask, cfg, ref)
    (ref_grad,) = torch.autograd.grad(ref_loss, leaf)
    br_loss, br_grad, br_stats = _per_branch_grads(logp, old, ref, adv, mask, lengths, cfg)

    assert abs(br_loss.item() - ref_loss.item()) < 1e-12, (br_loss.item(), ref_loss.item())
    assert torch.allclose(br_grad, ref_grad, rtol=1e-12, atol=1e-14), _diff(br_grad, ref_grad)
    assert ref_grad.abs().sum() > 0  # the case exercises a real gradient
    assert (ref_grad[mask == 0] == 0).all()  # holes and padding get no gradient
    assert ref_stats.clip_ratio_region > 0  # ... and clipping
    if beta == 0.0:
        assert br_stats.kl is None and ref_stats.kl is None
    else:
        assert br_stats.kl == pytest.approx(ref_stats.kl, rel=1e-12)
    for name in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region"):
        assert getattr(br_stats, name) == pytest.approx(getattr(ref_stats, name), rel=1e-12), name


@pytest.mark.parametrize(
    ("loss_type", "level"), list(itertools.product(LOSS_TYPES, ["token", "sequence"]))
)
def test_branch_gradients_match_batched_in_fp32(loss_type, level):
    # Measured: loss |diff| <= 3e-8, gradient max |diff| <= 2e-9 (relative 6e-8).
    lengths = [63, 17, 40, 1, 29, 63, 8]
    cfg = GRPOConfig(
        loss_type=loss_type,
        beta=0.04,
        epsilon_high=0.28,
        max_completion_length=63,
        importance_sampling_level=level,
    )
    logp, old, ref, adv, mask = _random_batch(lengths, torch.float32)
    leaf = logp.clone().requires_grad_(True)
    ref_loss, _ = group_loss(leaf, old, adv, mask, cfg, ref, num_items_in_batch=500)
    (ref_grad,) = torch.autograd.grad(ref_loss, leaf)
    br_loss, br_grad, _ = _per_branch_grads(logp, old, ref, adv, mask, lengths, cfg, num_items=500)
    torch.testing.assert_close(br_loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(br_grad, ref_grad, rtol=1e-5, atol=1e-6), _diff(br_grad, ref_grad)


def test_engine_contract_grpo_on_policy_gradient():
    # loss_type grpo, beta 0, old = current: grad = that of
    #   L = -(1/G) sum_i (A_i/|y_i|) sum_t exp(logp_it - stopgrad(logp_it)) over unmasked t.
    lengths = [7, 13, 1, 10, 4]
    cfg = GRPOConfig(loss_type="grpo", beta=0.0)
    logp, _, _, adv, mask = _random_batch(lengths, torch.float64)
    g = len(lengths)
    expected = torch.zeros_like(logp)  # written out as a loop: -(1/G) A_i / |y_i| on each token
    for i in range(g):
        n_i = mask[i].sum().item()
        for t in range(logp.shape[1]):
            if mask[i, t] != 0:
                expected[i, t] = -(1.0 / g) * adv[i].item() / n_i
    leaf = logp.clone().requires_grad_(True)
    contract = -(1.0 / g) * sum(
        adv[i] / mask[i].sum() * (torch.exp(leaf[i] - leaf[i].detach()) * mask[i]).sum()
        for i in range(g)
    )
    (g_contract,) = torch.autograd.grad(contract, leaf)
    (g_ref,) = torch.autograd.grad(group_loss(leaf, None, adv, mask, cfg)[0], leaf)
    _, g_br, _ = _per_branch_grads(logp, logp, logp, adv, mask, lengths, cfg)
    for got in (g_contract, g_ref, g_br):
        assert torch.allclose(got, expected, rtol=1e-12, atol=1e-15), _diff(got, expected)


def test_old_logp_none_means_on_policy():
    cfg = GRPOConfig(loss_type="dapo", epsilon_high=0.28)
    logp, _, _, adv, mask = _random_batch([9, 5], torch.float64)
    leaf = logp[0].clone().requires_grad_(True)
    a, _ = branch_loss(leaf, None, adv[0], 0.1, cfg, mask_T=mask[0])
    b, _ = branch_loss(leaf, leaf.detach(), adv[0], 0.1, cfg, mask_T=mask[0])
    (ga,) = torch.autograd.grad(a, leaf)
    (gb,) = torch.autograd.grad(b, leaf)
    assert a.item() == b.item() and torch.equal(ga, gb)


# --- normalisers across a step with several groups ---------------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_per_group_weights_with_global_counts_match_weights_of_the_whole_batch(loss_type):
    cfg = GRPOConfig(loss_type=loss_type, max_completion_length=16)
    group_a, group_b = [7, 13, 1], [10, 4, 9]
    whole = sequence_weights(loss_type, group_a + group_b, cfg)
    per_group = torch.cat(
        [
            sequence_weights(loss_type, grp, cfg, num_items_in_batch=44, num_sequences_in_batch=6)
            for grp in (group_a, group_b)
        ]
    )
    assert torch.allclose(per_group, whole, rtol=1e-15), (per_group, whole)


def test_bnpo_weights_over_several_local_batches_average_the_local_losses():
    # TRL: bnpo normalises each micro-batch by its own tokens, then divides by accumulation steps.
    cfg = GRPOConfig(loss_type="bnpo")
    w = sequence_weights("bnpo", [7, 13, 1], cfg, num_sequences_in_batch=6)
    assert torch.allclose(w, torch.full((3,), 1.0 / (21 * 2), dtype=torch.float64))


def test_sequence_weights_reject_inconsistent_counts():
    cfg = GRPOConfig()
    with pytest.raises(ValueError, match="num_items_in_batch"):
        sequence_weights("dapo", [5, 6], cfg, num_items_in_batch=10)
    with pytest.raises(ValueError, match="num_sequences_in_batch"):
        sequence_weights("grpo", [5, 6, 7], cfg, num_sequences_in_batch=2)
    with pytest.raises(
        ValueError, match=r"unknown loss_type 'ppo'.*'bnpo', 'dapo', 'dr_grpo', 'grpo'"
    ):
        sequence_weights("ppo", [5], cfg)


# --- robustness and registry -------------------------------------------------------------------


def test_padding_with_minus_inf_logprobs_gives_finite_loss_and_gradient():
    cfg = GRPOConfig(loss_type="grpo", beta=0.04, importance_sampling_level="sequence")
    logp = torch.tensor([-1.0, -0.5, float("-inf")], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.1, -0.4, float("-inf")], dtype=torch.float64)
    ref = torch.tensor([-0.9, -0.6, float("-inf")], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    loss, stats = branch_loss(logp, old, 0.7, 0.25, cfg, ref, mask)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all(), (loss, g)
    assert g[2] == 0 and stats.num_tokens == 2


def test_beta_without_reference_logprobs_says_what_to_pass():
    cfg = GRPOConfig(beta=0.04)
    logp = torch.zeros(3)
    with pytest.raises(ValueError, match="ref_logp_T"):
        branch_loss(logp, None, 1.0, 1.0, cfg)
    with pytest.raises(ValueError, match="ref_logp_GT"):
        group_loss(logp[None], None, torch.ones(1), torch.ones(1, 3), cfg)


def test_loss_registry_lists_names_and_accepts_new_types():
    assert sorted(LOSSES) == ["bnpo", "dapo", "dr_grpo", "grpo"]
    with pytest.raises(ValueError, match="registered loss types"):
        get_loss("nope")

    @register_loss("test_sum_only")
    def sum_only(lengths_G, cfg, *, num_items_in_batch, num_sequences_in_batch):
        return torch.ones_like(lengths_G)

    try:
        assert get_loss("test_sum_only").sequence_weights is sum_only
        assert sequence_weights("test_sum_only", [3, 4], GRPOConfig()).tolist() == [1.0, 1.0]
        with pytest.raises(ValueError, match="already registered"):
            register_loss("test_sum_only")(lambda *a, **k: None)
    finally:
        del LOSSES["test_sum_only"]


def test_truncated_completions_are_masked_only_when_configured():
    mask = torch.ones(3, 4)
    truncated = torch.tensor([False, True, False])
    assert torch.equal(loss_mask(mask, truncated, GRPOConfig()), mask)
    masked = loss_mask(mask, truncated, GRPOConfig(mask_truncated_completions=True))
    assert masked.sum(-1).tolist() == [4.0, 0.0, 4.0]
    assert loss_mask(mask[0], True, GRPOConfig(mask_truncated_completions=True)).sum() == 0
