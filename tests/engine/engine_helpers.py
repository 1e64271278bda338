"""References and comparisons shared by the engine tests.

Legend: P prompt tokens, T = P - 1 state tokens, R response tokens, G responses, V vocab.

Every reference here runs the transformers model classes unmodified (sdpa attention, their own
caches); the one change, in `stock_cached_branch_logprobs`, is documented where it is made.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

from longstraw.grpo.losses import branch_loss, group_loss, sequence_weights
from longstraw.schemas.grpo import GRPOConfig

SEED = 42
# The families the engine supports (GLM-5 / glm_moe_dsa lands with its own issue).
ENGINE_FAMILIES = ("llama", "qwen3", "qwen3_5", "qwen3_next")
HYBRID_FAMILIES = ("qwen3_5", "qwen3_next")
# STYLE.md: fp32 reorderings.
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6


# --- inputs ------------------------------------------------------------------------------------


def random_ids(length: int, vocab_size: int, *, seed: int = SEED) -> torch.Tensor:
    """[length] int64 token ids, reproducible per seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=gen)


def random_group(
    prompt_len: int, response_lens: Sequence[int], vocab_size: int, *, seed: int = SEED
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """(prompt [P], responses [G][R_i], advantages [G] with mixed signs) for one group."""
    prompt = random_ids(prompt_len, vocab_size, seed=seed)
    responses = [random_ids(r, vocab_size, seed=seed + 1 + i) for i, r in enumerate(response_lens)]
    gen = torch.Generator().manual_seed(seed + 1000)
    advantages = torch.randn(len(response_lens), generator=gen)
    return prompt, responses, advantages


def vocab_of(model) -> int:
    return model.config.get_text_config().vocab_size


# --- comparisons -------------------------------------------------------------------------------


def diff_message(actual: torch.Tensor, expected: torch.Tensor) -> str:
    d = (actual.double() - expected.double()).abs()
    return f"max_diff={d.max().item():.3e} mean_diff={d.mean().item():.3e}"


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, what: str, rtol: float, atol: float
) -> None:
    """Elementwise |a - e| <= atol + rtol * |e|, with max/mean diff in the failure message."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    diff = (actual.double() - expected.double()).abs()
    bound = atol + rtol * expected.double().abs()
    assert bool((diff <= bound).all()), (
        f"{what}: {diff_message(actual, expected)} (rtol={rtol}, atol={atol})"
    )


def max_abs(grads: dict[str, torch.Tensor]) -> float:
    return max(float(g.abs().max()) for g in grads.values())


def assert_grads_close(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    *,
    rtol: float = FP32_RTOL,
    atol_scale: float = FP32_ATOL,
    what: str = "",
) -> float:
    """Every parameter: |a - e| <= rtol * |e| + atol_scale * max|e| over the whole model.

    The absolute term is scaled by the model's largest gradient: tiny random models have
    gradients from 1e-9 to 1e-1, and an fp32 reordering leaves an error relative to the largest
    terms summed, not to each element. Returns the largest error in units of max|e|.
    """
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    scale = max_abs(expected)
    assert scale > 0, "the reference gradient is all zeros: the test would check nothing"
    worst = 0.0
    for name, exp in expected.items():
        act = actual[name]
        assert torch.isfinite(act).all(), f"{what} {name}: non-finite gradient"
        diff = (act.double() - exp.double()).abs()
        bound = rtol * exp.double().abs() + atol_scale * scale
        worst = max(worst, float(diff.max()) / scale)
        assert bool((diff <= bound).all()), (
            f"{what} {name}: {diff_message(act, exp)} max|ref|={scale:.3e} "
            f"(rtol={rtol}, atol={atol_scale}*max|ref|)"
        )
    return worst


def rms_relative(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """||a - e|| / ||e|| over all parameters together."""
    num = sum(float((actual[n].double() - e.double()).pow(2).sum()) for n, e in expected.items())
    den = sum(float(e.double().pow(2).sum()) for e in expected.values())
    return (num / den) ** 0.5


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    dot = sum(float((a[n].double() * b[n].double()).sum()) for n in b)
    na = sum(float(a[n].double().pow(2).sum()) for n in b) ** 0.5
    nb = sum(float(b[n].double().pow(2).sum()) for n in b) ** 0.5
    return dot / (na * nb)


# --- gradients ---------------------------------------------------------------------------------


def zero_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def take_grads(model) -> dict[str, torch.Tensor]:
    """fp32 copy of every trainable parameter's .grad (zeros where none), then clear them."""
    grads = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            grads[name] = (
                torch.zeros(p.shape, dtype=torch.float32)
                if p.grad is None
                else p.grad.detach().float().clone()
            )
            p.grad = None
    return grads


# --- references --------------------------------------------------------------------------------


def full_sequence_logprobs(
    model, prompt: torch.Tensor, response: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """[R] fp32 log-probs of `response` from one plain transformers forward over prompt+response."""
    ids = torch.cat([prompt, response]).unsqueeze(0)
    logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, response.unsqueeze(-1)).squeeze(-1)


def _rebinding_update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
    # transformers' LinearAttentionLayer.update_recurrent_state does
    # `self.recurrent_states[idx].copy_(new)`: the tensor it overwrites is the one the chunked
    # gated delta rule saved for backward as `initial_state`, so backward fails with "modified by
    # an inplace operation" (docs/design.md). Rebinding stores the same values without the write.
    if not self.is_recurrent_states_initialized[state_idx]:
        self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
    self.recurrent_states[state_idx] = recurrent_states
    return recurrent_states


def stock_prefilled_cache(model, prompt: torch.Tensor) -> DynamicCache:
    """A fresh transformers `DynamicCache` holding `prompt[:-1]`, prefilled under no_grad, with
    its linear-attention layers made autograd-safe (see `stock_cached_branch_logprobs`)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt[:-1].unsqueeze(0), cache=cache, use_cache=True)
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.activate_past_recording()
            layer.update_recurrent_state = types.MethodType(
                _rebinding_update_recurrent_state, layer
            )
    return cache


def stock_cached_branch_logprobs(
    model,
    prompt: torch.Tensor,
    response: torch.Tensor,
    *,
    temperature: float = 1.0,
    cache: DynamicCache | None = None,
) -> torch.Tensor:
    """[R] log-probs via transformers' own cached path, with autograd on the branch only.

    A FRESH `DynamicCache` per call; `prompt[:-1]` prefilled into it under no_grad; then
    `[prompt[-1]] + response[:-1]` with autograd on that cache. This is the detached-gradient
    reference (docs/design.md, reference table). For linear-attention layers two things of the stock cache are
    changed after the no-grad prefill and before the branch, both only to make autograd through
    the branch possible, neither changing a computed value:

    - `activate_past_recording()`: the conv state is then rebound (`conv_states = cat(...)`)
      instead of `copy_`-ed, and the model never takes its 1-token `causal_conv1d_update`
      path, which also writes in place. The conv then sees [whole recorded past ; branch], of
      which the depthwise causal conv reads only the last kernel-1 columns before each token.
    - `update_recurrent_state` rebinds instead of `copy_` (see `_rebinding_update_recurrent_state`).

    `cache`: one from `stock_prefilled_cache(model, prompt)`, used once (the branch extends it).
    Full-attention layers are stock `DynamicLayer`s: they `torch.cat` the prefix and branch K/V
    (the P-sized copy LongStraw avoids), which is what makes this an independent reference.
    """
    if cache is None:
        cache = stock_prefilled_cache(model, prompt)
    branch_ids = torch.cat([prompt[-1:], response[:-1]]).unsqueeze(0)
    logits = model(input_ids=branch_ids, cache=cache, use_cache=True).logits[0]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, response.unsqueeze(-1)).squeeze(-1)


def reference_group_gradient(
    model,
    prompt: torch.Tensor,
    responses: Sequence[torch.Tensor],
    advantages: torch.Tensor,
    cfg: GRPOConfig,
    *,
    path: str,
) -> dict[str, torch.Tensor]:
    """Per-sequence backward of each response's `branch_loss` share, summed over the group.

    `path="full"`: log-probs from plain full-sequence autograd over prompt+response (the exact
    gradient). `path="cached"`: from transformers' cached path with the prompt under no_grad
    (the detached gradient).
    """
    logprobs = full_sequence_logprobs if path == "full" else stock_cached_branch_logprobs
    weights = sequence_weights(cfg.loss_type, [r.numel() for r in responses], cfg)
    zero_grads(model)
    for i, response in enumerate(responses):
        logp = logprobs(model, prompt, response, temperature=cfg.temperature)
        loss, _ = branch_loss(logp, None, float(advantages[i]), weights[i], cfg)
        loss.backward()
    return take_grads(model)


def batched_group_gradient(
    model,
    prompt: torch.Tensor,
    responses: Sequence[torch.Tensor],
    advantages: torch.Tensor,
    cfg: GRPOConfig,
    *,
    path: str,
    old_logprobs: Sequence[torch.Tensor] | None = None,
    ref_logprobs: Sequence[torch.Tensor] | None = None,
    loss_masks: Sequence[torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """One backward of TRL's batched `group_loss` over the padded [G, R_max] group.

    Log-probs of every response are computed first (all graphs alive), padded, and reduced at
    once, as TRL does; `path` as in `reference_group_gradient`. Returns (grads, loss).
    """
    logprobs = full_sequence_logprobs if path == "full" else stock_cached_branch_logprobs
    num, width = len(responses), max(r.numel() for r in responses)

    def padded(rows: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack(
            [
                torch.nn.functional.pad(
                    torch.as_tensor(r, dtype=torch.float32), (0, width - len(r))
                )
                for r in rows
            ]
        )

    zero_grads(model)
    logp_GT = padded([logprobs(model, prompt, r, temperature=cfg.temperature) for r in responses])
    if loss_masks is None:
        loss_masks = [torch.ones(r.numel()) for r in responses]
    mask_GT = padded(loss_masks)
    old_GT = None if old_logprobs is None else padded(old_logprobs)
    ref_GT = None if ref_logprobs is None else padded(ref_logprobs)
    assert mask_GT.shape == (num, width)
    loss, _ = group_loss(logp_GT, old_GT, advantages.float(), mask_GT, cfg, ref_GT)
    loss.backward()
    return take_grads(model), float(loss)
