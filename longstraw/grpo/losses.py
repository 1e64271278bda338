"""GRPO losses with TRL 1.16 semantics, split so that one branch at a time reproduces the group.

Legend: G sequences in the batch the normaliser spans, T completion positions (padded in a batch;
a branch has its own T). `logp` are per-token log-probs of the sampled tokens under the current
policy, `old_logp` under the policy that sampled them, `ref_logp` under the reference model;
`mask` is 1 on tokens that count (completion tokens; holes allowed), 0 elsewhere.

TRL's `GRPOTrainer._compute_loss` computes, on a padded batch [G, T]:

    ratio      = exp(logp - old_logp)                       (token level), or
                 exp(sum_t mask*(logp-old_logp) / max(|y|,1)) broadcast over t  (sequence level, GSPO)
    clipped    = clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    ratio      = min(ratio, delta)                           (only if delta is set; after `clipped`)
    loss_it    = -min(ratio * A_i, clipped * A_i) + beta * (exp(ref - logp) - (ref - logp) - 1)
    loss       = aggregate(loss_it * mask_it)                (per loss_type, see below)

Every aggregation TRL offers is linear in the masked per-token losses with a coefficient that is
fixed per *sequence* and depends only on token counts:

    loss = sum_i w_i * sum_t mask_it * loss_it
    grpo    w_i = 1 / (max(|y_i|, 1) * num_sequences)        mean over tokens, then sequences
    bnpo    w_i = 1 / (max(sum_j |y_j|, 1) * num_local_batches)   tokens of the local batch
    dr_grpo w_i = 1 / (num_sequences * max_completion_length)
    dapo    w_i = 1 / max(num_items_in_batch, 1)             completion tokens in the whole step

So LongStraw fixes w_i from the group's token counts BEFORE replay (`sequence_weights`), then
replays one branch at a time (`branch_loss`) and backpropagates w_i * sum_t mask*loss_it; the sum
of the per-branch gradients is the gradient of the batched loss (`group_loss`, the reference).
Sequence-level importance sampling needs the whole sequence, which a branch is.

Engine contract. With loss_type="grpo", beta=0 and old log-probs equal to the current ones (the
default when `old_logp` is None, which is what TRL does when num_iterations == 1) the ratio is 1,
nothing is clipped, and the gradient equals that of

    L = -(1/G) sum_i (A_i / |y_i|) sum_t exp(logp_it - stopgrad(logp_it)),

i.e. -(1/G) sum_i (A_i/|y_i|) sum_t grad logp_it.

Deviations from TRL, each where TRL would produce NaN or divide by zero: the log-ratio and the KL
argument are zeroed at masked positions before exp (TRL multiplies by the mask after exp, so a
padded -inf log-prob gives 0 * inf = NaN there); the dapo normaliser is clamped to >= 1 like the
others (TRL divides by num_items_in_batch unclamped). Gradient-accumulation and multi-process
factors that TRL applies outside the formula are folded into `num_sequences_in_batch` and
`num_items_in_batch` (see `sequence_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from longstraw.schemas.grpo import GRPOConfig

# TRL clamps every token count to >= 1 so that a fully masked sequence (or batch) divides by 1, not
# 0: its masked loss is 0 anyway.
_MIN_TOKEN_COUNT = 1.0


# --- statistics --------------------------------------------------------------------------------


@dataclass(frozen=True)
class BranchStats:
    """Sums behind TRL's logged loss statistics, for one branch or any set of sequences.

    Sums add across branches; `reduce_stats` divides once at the end, so per-branch stats reduce
    to exactly the batch statistics TRL logs. All fields are detached 0-d tensors.
    """

    num_tokens: Tensor
    """Masked completion tokens."""
    kl_sum: Tensor | None
    """Sum over masked tokens of the k3 KL to the reference; None when beta == 0."""
    num_clip_units: Tensor
    """Denominator of the clip ratios: tokens (token level) or sequences (sequence level), as
    TRL's `masked_batch_mean`."""
    low_clip_sum: Tensor
    """Units whose ratio is below 1 - epsilon with a negative advantage."""
    high_clip_sum: Tensor
    """Units whose ratio is above 1 + epsilon_high with a positive advantage."""
    region_clip_sum: Tensor
    """Units clipped either way."""

    def __add__(self, other: BranchStats) -> BranchStats:
        kl = None if self.kl_sum is None or other.kl_sum is None else self.kl_sum + other.kl_sum
        return BranchStats(
            num_tokens=self.num_tokens + other.num_tokens,
            kl_sum=kl,
            num_clip_units=self.num_clip_units + other.num_clip_units,
            low_clip_sum=self.low_clip_sum + other.low_clip_sum,
            high_clip_sum=self.high_clip_sum + other.high_clip_sum,
            region_clip_sum=self.region_clip_sum + other.region_clip_sum,
        )


@dataclass(frozen=True)
class LossStats:
    """TRL's logged loss statistics for a batch (one process, one micro-batch)."""

    kl: float | None
    """Mean k3 KL per masked token; None when beta == 0 (TRL does not log it then)."""
    clip_ratio_low: float
    """Fraction of units clipped at 1 - epsilon (negative advantage)."""
    clip_ratio_high: float
    """Fraction of units clipped at 1 + epsilon_high (positive advantage)."""
    clip_ratio_region: float
    """Fraction of units clipped either way."""

    def as_metrics(self) -> dict[str, float]:
        """The statistics under TRL's metric names."""
        metrics = {
            "clip_ratio/low_mean": self.clip_ratio_low,
            "clip_ratio/high_mean": self.clip_ratio_high,
            "clip_ratio/region_mean": self.clip_ratio_region,
        }
        if self.kl is not None:
            metrics["kl"] = self.kl
        return metrics


def reduce_stats(stats: Iterable[BranchStats]) -> LossStats:
    """Batch statistics from per-branch sums (order-independent up to float addition)."""
    items = list(stats)
    assert items, "reduce_stats needs at least one BranchStats"
    total = items[0]
    for s in items[1:]:
        total = total + s
    tokens = max(float(total.num_tokens), _MIN_TOKEN_COUNT)
    units = max(float(total.num_clip_units), _MIN_TOKEN_COUNT)
    return LossStats(
        kl=None if total.kl_sum is None else float(total.kl_sum) / tokens,
        clip_ratio_low=float(total.low_clip_sum) / units,
        clip_ratio_high=float(total.high_clip_sum) / units,
        clip_ratio_region=float(total.region_clip_sum) / units,
    )


# --- per-token objective -----------------------------------------------------------------------


def _loss_dtype(logp: Tensor) -> torch.dtype:
    # The loss is computed in at least fp32 whatever the model dtype (DESIGN: fp32 gradients).
    return torch.promote_types(logp.dtype, torch.float32)


def clipped_surrogate_objective(
    logp_T: Tensor,
    old_logp_T: Tensor | None,
    advantage: float | Tensor,
    cfg: GRPOConfig,
    ref_logp_T: Tensor | None = None,
    mask_T: Tensor | None = None,
) -> tuple[Tensor, BranchStats]:
    """Per-token PPO-clip loss (+ beta * k3 KL) of TRL's grpo/bnpo/dr_grpo/dapo.

    Shapes: `logp_T`, `old_logp_T`, `ref_logp_T`, `mask_T` are [..., T] (one branch: [T]);
    `advantage` is a scalar or [...]. Returns the per-token loss [..., T] (not yet masked) and the
    statistic sums over everything passed. `old_logp_T=None` means on-policy (logp.detach()).
    """
    dtype = _loss_dtype(logp_T)
    logp = logp_T.to(dtype)
    old = logp.detach() if old_logp_T is None else old_logp_T.to(dtype)
    mask = torch.ones_like(logp) if mask_T is None else mask_T.to(dtype)
    keep = mask != 0
    adv = torch.as_tensor(advantage, dtype=dtype, device=logp.device).unsqueeze(-1)  # [..., 1]
    eps_low, eps_high = cfg.epsilon, cfg.effective_epsilon_high

    # Zeroed where masked so that garbage log-probs at padding cannot turn into inf * 0 = NaN.
    log_ratio = torch.where(keep, logp - old, torch.zeros_like(logp))
    if cfg.importance_sampling_level == "sequence":
        num = (log_ratio * mask).sum(-1, keepdim=True)
        log_weight = num / mask.sum(-1, keepdim=True).clamp(min=_MIN_TOKEN_COUNT)  # [..., 1]
    else:
        log_weight = log_ratio  # [..., T]
    coef_1 = torch.exp(log_weight)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    if cfg.delta is not None:
        # TRL clamps after computing the clipped term, so `delta` only caps the unclipped one.
        coef_1 = torch.clamp(coef_1, max=cfg.delta)
    loss = -torch.min(coef_1 * adv, coef_2 * adv)

    kl = None
    if cfg.beta != 0.0:
        if ref_logp_T is None:
            raise ValueError(
                f"beta={cfg.beta} needs reference log-probs: pass ref_logp_T, or set beta=0.0"
            )
        diff = torch.where(keep, ref_logp_T.to(dtype) - logp, torch.zeros_like(logp))
        kl = torch.exp(diff) - diff - 1
        loss = loss + cfg.beta * kl
    loss = loss.expand_as(logp)  # sequence level: one value per sequence, counted on each token

    with torch.no_grad():
        is_low = (coef_1 < 1 - eps_low) & (adv < 0)
        is_high = (coef_1 > 1 + eps_high) & (adv > 0)
        is_region = is_low | is_high
        # TRL's masked_batch_mean: a token mean at token level, a plain sequence mean at sequence
        # level (every sequence counts, even an empty one).
        unit_w = mask if cfg.importance_sampling_level == "token" else torch.ones_like(coef_1)
        stats = BranchStats(
            num_tokens=mask.sum(),
            kl_sum=None if kl is None else (kl.detach() * mask).sum(),
            num_clip_units=unit_w.sum(),
            low_clip_sum=(is_low * unit_w).sum(),
            high_clip_sum=(is_high * unit_w).sum(),
            region_clip_sum=(is_region * unit_w).sum(),
        )
    return loss, stats


# --- loss registry -----------------------------------------------------------------------------


class SequenceWeightFn(Protocol):
    """w_i for each sequence from token counts; defaults already resolved by `sequence_weights`."""

    def __call__(
        self,
        completion_lengths_G: Tensor,
        cfg: GRPOConfig,
        *,
        num_items_in_batch: float,
        num_sequences_in_batch: int,
    ) -> Tensor: ...


PerTokenObjectiveFn = Callable[..., tuple[Tensor, BranchStats]]


@dataclass(frozen=True)
class LossFn:
    """One registered loss type: a per-token objective and a per-sequence normaliser."""

    name: str
    sequence_weights: SequenceWeightFn
    per_token_objective: PerTokenObjectiveFn


LOSSES: dict[str, LossFn] = {}


def register_loss(
    name: str, per_token_objective: PerTokenObjectiveFn = clipped_surrogate_objective
) -> Callable[[SequenceWeightFn], SequenceWeightFn]:
    """Register the decorated sequence-weight function as loss type `name`."""

    def decorate(fn: SequenceWeightFn) -> SequenceWeightFn:
        if name in LOSSES and LOSSES[name].sequence_weights is not fn:
            raise ValueError(f"loss type {name!r} is already registered; pick another name")
        LOSSES[name] = LossFn(name, fn, per_token_objective)
        return fn

    return decorate


def get_loss(name: str) -> LossFn:
    """The registered loss type `name`; ValueError listing the registered names otherwise."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(
            f"unknown loss_type {name!r}; registered loss types: {sorted(LOSSES)}"
        ) from None


@register_loss("grpo")
def grpo_weights(lengths_G, cfg, *, num_items_in_batch, num_sequences_in_batch):
    # TRL: ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean() / accumulation_steps
    return 1.0 / (lengths_G.clamp(min=_MIN_TOKEN_COUNT) * num_sequences_in_batch)


@register_loss("bnpo")
def bnpo_weights(lengths_G, cfg, *, num_items_in_batch, num_sequences_in_batch):
    # TRL: (loss * mask).sum() / mask.sum().clamp(min=1) over the LOCAL batch (these sequences),
    # then / accumulation steps and averaged over processes: i.e. / the number of local batches.
    num_local_batches = num_sequences_in_batch / lengths_G.numel()
    local_tokens = lengths_G.sum().clamp(min=_MIN_TOKEN_COUNT)
    return torch.full_like(lengths_G, 1.0) / (local_tokens * num_local_batches)


@register_loss("dr_grpo")
def dr_grpo_weights(lengths_G, cfg, *, num_items_in_batch, num_sequences_in_batch):
    # TRL: (loss * mask).sum() / (num_sequences * max_completion_length) / accumulation_steps
    denom = float(num_sequences_in_batch * cfg.max_completion_length)
    return torch.full_like(lengths_G, 1.0 / denom)


@register_loss("dapo")
def dapo_weights(lengths_G, cfg, *, num_items_in_batch, num_sequences_in_batch):
    # TRL: (loss * mask).sum() / (num_items_in_batch / num_processes), with DDP averaging over
    # processes: the global masked sum / the global completion-token count.
    return torch.full_like(lengths_G, 1.0 / max(float(num_items_in_batch), _MIN_TOKEN_COUNT))


def sequence_weights(
    loss_type: str,
    completion_lengths_G: Tensor | Sequence[int],
    cfg: GRPOConfig,
    num_items_in_batch: float | None = None,
    num_sequences_in_batch: int | None = None,
) -> Tensor:
    """[G] fp64 weights w_i with loss = sum_i w_i * sum_t mask_it * loss_it, fixed before replay.

    `completion_lengths_G`: masked token count of each sequence these weights are for (one group,
    or TRL's local micro-batch). `num_sequences_in_batch`: sequences the loss averages over
    (grpo, dr_grpo; for bnpo it gives the number of equal-sized local batches,
    num_sequences_in_batch / G) across groups, gradient accumulation and processes; default G.
    `num_items_in_batch`: completion tokens the loss averages over (dapo), the global count across
    accumulation and processes; default the tokens of these sequences.
    """
    lengths = torch.as_tensor(completion_lengths_G, dtype=torch.float64).detach().cpu()
    if lengths.dim() != 1 or lengths.numel() == 0:
        raise ValueError(
            f"completion_lengths_G must be a non-empty 1-D list, got shape {tuple(lengths.shape)}"
        )
    if (lengths < 0).any():
        raise ValueError(f"completion lengths must be >= 0, got {lengths.tolist()}")
    num_g = lengths.numel()
    local_items = float(lengths.sum())
    if num_sequences_in_batch is None:
        num_sequences_in_batch = num_g
    if num_sequences_in_batch < num_g:
        raise ValueError(
            f"num_sequences_in_batch={num_sequences_in_batch} is smaller than the {num_g} sequences "
            "passed; pass the count over the whole batch (all groups, accumulation, processes)"
        )
    if num_items_in_batch is None:
        num_items_in_batch = local_items
    if float(num_items_in_batch) < local_items:
        raise ValueError(
            f"num_items_in_batch={num_items_in_batch} is smaller than the {local_items:g} completion "
            "tokens of these sequences; pass the token count over the whole batch"
        )
    weights = get_loss(loss_type).sequence_weights(
        lengths,
        cfg,
        num_items_in_batch=float(num_items_in_batch),
        num_sequences_in_batch=int(num_sequences_in_batch),
    )
    assert weights.shape == lengths.shape, (weights.shape, lengths.shape)
    return weights


def loss_mask(mask_T: Tensor, is_truncated: bool | Tensor, cfg: GRPOConfig) -> Tensor:
    """The mask the loss uses: `mask_T` [..., T], zeroed for truncated completions when
    `cfg.mask_truncated_completions` (as TRL). `is_truncated` is a bool or [...] bools. Compute
    the completion lengths for `sequence_weights` from this mask, as TRL's normalisers do."""
    if not cfg.mask_truncated_completions:
        return mask_T
    keep = ~torch.as_tensor(is_truncated, dtype=torch.bool, device=mask_T.device)
    return mask_T * keep.unsqueeze(-1).to(mask_T.dtype)


# --- per-branch and batched loss ---------------------------------------------------------------


def branch_loss(
    logp_T: Tensor,
    old_logp_T: Tensor | None,
    advantage: float | Tensor,
    weight: float | Tensor,
    cfg: GRPOConfig,
    ref_logp_T: Tensor | None = None,
    mask_T: Tensor | None = None,
    token_weights_T: Tensor | None = None,
) -> tuple[Tensor, BranchStats]:
    """One branch's share of the batch loss: weight * sum_t mask_t * iw_t * loss_t (a 0-d tensor).

    `weight` is this branch's entry of `sequence_weights(...)`. Summed over the batch's branches
    this equals `group_loss`, and so do the gradients. `token_weights_T` (constants) are TRL's
    truncated importance weights for responses sampled by another engine (`importance_weights`).
    """
    objective = get_loss(cfg.loss_type).per_token_objective
    loss_T, stats = objective(logp_T, old_logp_T, advantage, cfg, ref_logp_T, mask_T)
    mask = torch.ones_like(loss_T) if mask_T is None else mask_T.to(loss_T.dtype)
    if token_weights_T is not None:
        mask = mask * token_weights_T.to(loss_T.dtype).detach()
    w = torch.as_tensor(weight, dtype=loss_T.dtype, device=loss_T.device)
    return w * (loss_T * mask).sum(), stats


def importance_weights(old_logp_T: Tensor, sampler_logp_T: Tensor, cap: float) -> Tensor:
    """TRL's truncated importance sampling weight for another engine's samples (TIS):
    min(exp(logp_old - logp_sampler), cap), per token, without gradient."""
    return torch.exp(old_logp_T.detach().double() - sampler_logp_T.double()).clamp(max=cap)


# TRL 1.16's aggregations, transcribed (num_processes = accumulation steps = 1).
_TRL_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, GRPOConfig, Tensor], Tensor]] = {
    "grpo": lambda loss, mask, cfg, n: ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(),
    "bnpo": lambda loss, mask, cfg, n: (loss * mask).sum() / mask.sum().clamp(min=1.0),
    "dr_grpo": lambda loss, mask, cfg, n: (
        (loss * mask).sum() / (loss.size(0) * cfg.max_completion_length)
    ),
    "dapo": lambda loss, mask, cfg, n: (loss * mask).sum() / n.clamp(min=1.0),
}


def group_loss(
    logp_GT: Tensor,
    old_logp_GT: Tensor | None,
    advantages_G: Tensor,
    mask_GT: Tensor,
    cfg: GRPOConfig,
    ref_logp_GT: Tensor | None = None,
    num_items_in_batch: float | None = None,
    token_weights_GT: Tensor | None = None,
) -> tuple[Tensor, LossStats]:
    """The reference: TRL 1.16's batched `_compute_loss` on a padded [G, T] batch, line for line.

    One process, no gradient accumulation. `num_items_in_batch` (dapo) defaults to mask.sum().
    Written independently of the per-branch path so that the two can be tested against each other.
    """
    dtype = _loss_dtype(logp_GT)
    logp = logp_GT.to(dtype)
    mask = mask_GT.to(dtype)
    old = logp.detach() if old_logp_GT is None else old_logp_GT.to(dtype)
    adv = advantages_G.to(dtype).unsqueeze(1)  # [G, 1]

    log_ratio = logp - old
    if cfg.importance_sampling_level == "token":
        log_iw = log_ratio
    else:
        log_iw = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_iw)
    coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon, 1 + cfg.effective_epsilon_high)
    if cfg.delta is not None:
        coef_1 = torch.clamp(coef_1, max=cfg.delta)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    per_token_kl = None
    if cfg.beta != 0.0:
        if ref_logp_GT is None:
            raise ValueError(
                f"beta={cfg.beta} needs reference log-probs: pass ref_logp_GT, or set beta=0.0"
            )
        ref = ref_logp_GT.to(dtype)
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token_loss = per_token_loss + cfg.beta * per_token_kl
    if token_weights_GT is not None:
        per_token_loss = per_token_loss * token_weights_GT.to(dtype)

    n = (
        mask.sum()
        if num_items_in_batch is None
        else torch.tensor(float(num_items_in_batch), dtype=dtype)
    )
    loss = _TRL_AGGREGATIONS[cfg.loss_type](per_token_loss, mask, cfg, n)

    with torch.no_grad():
        token_count = mask.sum().clamp(min=1.0)

        def masked_batch_mean(x: Tensor) -> float:
            if x.shape[1] == 1:  # sequence level
                return float(x.mean())
            return float((x * mask).sum() / token_count)

        is_low = ((coef_1 < 1 - cfg.epsilon) & (adv < 0)).to(dtype)
        is_high = ((coef_1 > 1 + cfg.effective_epsilon_high) & (adv > 0)).to(dtype)
        is_region = ((is_low + is_high) > 0).to(dtype)
        stats = LossStats(
            kl=None if per_token_kl is None else masked_batch_mean(per_token_kl.detach()),
            clip_ratio_low=masked_batch_mean(is_low),
            clip_ratio_high=masked_batch_mean(is_high),
            clip_ratio_region=masked_batch_mean(is_region),
        )
    return loss, stats
