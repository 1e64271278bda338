"""Tokens with loss mask 0 (tool and environment output inside a trajectory) never reach the loss.

For every registered loss type, both importance-sampling levels and a KL term: changing the
log-probs (current, old, reference) of masked tokens changes neither the loss nor any gradient,
and the gradient with respect to a masked token's log-prob is exactly zero.
"""

from __future__ import annotations

import pytest
import torch

from longstraw.grpo.losses import LOSSES, branch_loss, sequence_weights
from longstraw.schemas.grpo import GRPOConfig

SEED = 42
LENGTH = 13


def _inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(LENGTH, generator=gen, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(LENGTH, generator=gen, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(LENGTH, generator=gen, dtype=torch.float64)
    return logp, old, ref


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_masked_tokens_change_neither_loss_nor_gradient(loss_type, level):
    cfg = GRPOConfig(
        loss_type=loss_type, beta=0.04, importance_sampling_level=level, max_completion_length=16
    )
    mask = torch.tensor([1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1], dtype=torch.float64)
    weight = sequence_weights(loss_type, [int(mask.sum())], cfg, num_items_in_batch=7)[0]
    logp, old, ref = _inputs(SEED)
    other_logp, other_old, other_ref = _inputs(SEED + 1)
    hidden = mask == 0
    # Masked positions get other values (one of them -inf: a tool token the policy finds impossible).
    logp2 = torch.where(hidden, other_logp, logp)
    logp2[3] = float("-inf")
    old2, ref2 = torch.where(hidden, other_old, old), torch.where(hidden, other_ref, ref)

    results = []
    for lp, o, r in ((logp, old, ref), (logp2, old2, ref2)):
        leaf = lp.clone().requires_grad_(True)
        loss, _ = branch_loss(leaf, o, 0.7, weight, cfg, r, mask)
        (grad,) = torch.autograd.grad(loss, leaf)
        results.append((loss.detach(), grad))
    (loss_a, grad_a), (loss_b, grad_b) = results
    assert torch.isfinite(loss_b)
    assert loss_a.item() != 0.0
    assert torch.equal(loss_a, loss_b), (loss_a.item(), loss_b.item())
    assert torch.equal(grad_a, grad_b)
    assert torch.equal(grad_a[hidden], torch.zeros(int(hidden.sum()), dtype=torch.float64))
    assert bool((grad_a[~hidden] != 0).all())
