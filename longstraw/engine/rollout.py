"""Rollout: sample G responses in one batch from the shared prompt state.

All G rows read the same prefix K/V (the prefix has no batch dimension; nothing of prompt size is
copied); each row's Gated DeltaNet state is a fork of the prompt's final state, rebound per step.
Step 0 feeds the prompt's last token (its output predicts y_1), every later step the token just
sampled. The sampler's log-probs are recorded as log_softmax(logits / temperature) of the chosen
token over the full vocabulary — the quantity training computes, so they can serve as old-policy
log-probs; top-k / top-p / min-p only restrict which tokens may be drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from longstraw.engine.exchange import LOCAL, PrefixExchange
from longstraw.engine.replay import decoding_cache, replay_logits
from longstraw.engine.state import PrefixState
from longstraw.engine.validation import check_positions


@dataclass(frozen=True)
class SamplingParams:
    """How responses are drawn (TRL's names where they exist)."""

    num_samples: int
    """G: rows sampled from the one prompt state."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    """A row ends after emitting one of these (kept in the response: the model must learn to stop)."""
    stop_strings: tuple[str, ...] = ()
    """A row ends once its decoded text contains one of these (needs a tokenizer)."""

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] or None, got {self.min_p}")


@dataclass
class Response:
    """One sampled response."""

    token_ids: list[int]
    logprobs: list[float]
    """Sampler log-probs, one per token: log_softmax(logits / temperature)[token]."""
    finish_reason: str
    """"stop" (stop token or string) or "length" (max_new_tokens reached: truncated)."""
    text: str | None = None
    metadata: dict = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def _filter_logits(logits_GV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Mask tokens top-k / top-p / min-p exclude (fp32 logits already divided by temperature)."""
    if params.top_k is not None and params.top_k < logits_GV.shape[-1]:
        kth = torch.topk(logits_GV, params.top_k, dim=-1).values[..., -1:]
        logits_GV = logits_GV.masked_fill(logits_GV < kth, float("-inf"))
    probs = torch.softmax(logits_GV, dim=-1)
    if params.min_p is not None:
        floor = probs.amax(-1, keepdim=True) * params.min_p
        logits_GV = logits_GV.masked_fill(probs < floor, float("-inf"))
        probs = torch.softmax(logits_GV, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        outside = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(outside).scatter(-1, order, outside)
        logits_GV = logits_GV.masked_fill(drop, float("-inf"))
    return logits_GV


def decode_response(tokenizer, token_ids: Sequence[int]) -> str:
    """The completion text rewards and stop strings see: special tokens (the kept stop token,
    `<|endoftext|>`) are not text, as TRL decodes completions with skip_special_tokens=True."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def decode(
    next_logits: Callable[[torch.Tensor], torch.Tensor],
    first_tokens_G1: torch.Tensor,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    tokenizer=None,
    after_draw: Callable[[torch.Tensor, int], None] | None = None,
) -> list[Response]:
    """The sampling loop, independent of where the logits come from.

    `next_logits(tokens_G1)` feeds the G rows' latest tokens [G, 1] to the model (advancing its
    cache) and returns the next-token logits [G, V]; `after_draw(choice_G1, step)` sees every
    draw before it is used (the sharded rollout checks there that all ranks drew the same). Rows
    that finished keep being fed (their draws are ignored) so the batch stays rectangular.
    """
    if params.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode responses; pass tokenizer=")
    rows = first_tokens_G1.shape[0]
    tokens_G1 = first_tokens_G1
    stop_ids = torch.tensor(list(params.stop_token_ids), dtype=torch.long, device=tokens_G1.device)
    sampled: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    finish: list[str | None] = [None] * rows
    for step in range(params.max_new_tokens):
        logits = next_logits(tokens_G1).float() / params.temperature
        full_logp = torch.log_softmax(logits, dim=-1)
        filtered = _filter_logits(logits, params)
        choice = torch.multinomial(
            torch.softmax(filtered, dim=-1), 1, generator=generator
        )  # [G, 1]
        if after_draw is not None:
            after_draw(choice, step)
        chosen_logp = full_logp.gather(-1, choice)[:, 0]
        is_stop = (
            torch.isin(choice[:, 0], stop_ids)
            if stop_ids.numel()
            else torch.zeros(rows, dtype=torch.bool)
        )
        # One conversion per step, not three tensor reads per row.
        choice_ids, chosen, stopped = choice[:, 0].tolist(), chosen_logp.tolist(), is_stop.tolist()
        for row in range(rows):
            if finish[row] is not None:
                continue
            sampled[row].append(choice_ids[row])
            logprobs[row].append(chosen[row])
            if stopped[row]:
                finish[row] = "stop"
            elif params.stop_strings:
                text = decode_response(tokenizer, sampled[row])
                if any(stop in text for stop in params.stop_strings):
                    finish[row] = "stop"
        if all(reason is not None for reason in finish):
            break
        tokens_G1 = choice
    responses = []
    for row in range(rows):
        text = decode_response(tokenizer, sampled[row]) if tokenizer is not None else None
        responses.append(Response(sampled[row], logprobs[row], finish[row] or "length", text))
    return responses


@torch.no_grad()
def sample_responses(
    model: PreTrainedModel,
    state: PrefixState,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    tokenizer=None,
    exchange: PrefixExchange = LOCAL,
) -> list[Response]:
    """Sample `params.num_samples` responses from `state` in one batch, its layers reading the
    prompt prefix as `exchange` says. On the ranks of a sequence group (`state` this rank's
    slice) call it on every rank with the same `params` and an identically seeded `generator`:
    every rank draws, and returns, the same responses."""
    check_positions(
        state.spec, state.prompt_len + params.max_new_tokens, what="prompt + max_new_tokens"
    )
    rows = params.num_samples
    cache = decoding_cache(state, exchange, batch_size=rows, branch_capacity=params.max_new_tokens)

    def next_logits(tokens_G1: torch.Tensor) -> torch.Tensor:
        logits_GV = replay_logits(model, state, tokens_G1, cache, exchange)[:, -1]
        cache.position_offset += 1
        return logits_GV

    first_G1 = torch.full((rows, 1), state.last_token_id, dtype=torch.long, device=model.device)
    # Installed once for the whole loop (each step's `replay_logits` then finds it in place).
    with exchange.layers.attention_enabled(model):
        return decode(
            next_logits,
            first_G1,
            params,
            generator=generator,
            tokenizer=tokenizer,
            after_draw=exchange.collectives.check_draws,
        )


@torch.no_grad()
def score_responses(
    model: PreTrainedModel,
    state: PrefixState,
    responses: Sequence[Sequence[int] | torch.Tensor],
    *,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """[G][R_i] log-probs of given responses on `state` without autograd (old-policy / reference).

    One branch forward per response (responses have unequal lengths; replay is one branch at a
    time anyway, and no sweep is ever needed for scoring).
    """
    from longstraw.engine.replay import branch_logprobs

    return [branch_logprobs(model, state, r, temperature=temperature) for r in responses]
