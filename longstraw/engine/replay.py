"""Branch replay: the log-probs of a response given the frozen prompt state.

The branch input is `[x_last] + y[:-1]` at positions T .. T+R-1 (T = P - 1): the prompt's last
token is replayed inside the branch because its output predicts y_1. Full-attention layers read
the prefix K/V through the prefix attention; Gated DeltaNet layers start from a fork of the final
recurrent state and conv tail (rebinding, never writing). The state is neither mutated nor copied.

In exact mode the branch also produces the cotangent of the prompt state it read: the prefix
attention adds dK/dV into `PromptCotangent` buffers, and the forked linear-attention state is a
leaf whose gradient is added to the cotangent of the final state after the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from longstraw.engine.attention import CACHE_KWARG
from longstraw.engine.cache import StateCache
from longstraw.engine.delta_rule import delta_rule_backward_recomputed
from longstraw.engine.exchange import LOCAL, PrefixExchange
from longstraw.engine.layer_kinds import COTANGENT_ARRAYS, branch_layers, nbytes
from longstraw.engine.state import PrefixState
from longstraw.engine.validation import as_token_tensor, check_positions
from longstraw.ops.blockwise_backward import BLOCK_TOKENS


@dataclass
class PromptCotangent:
    """fp32 cotangent dS of the prompt state, accumulated over branches (exact mode).

    Only the K/V part grows with the prompt; the linear-attention part is the cotangent of the
    *final* state (constant size) until the reverse sweep walks it back shard by shard.
    """

    keys: torch.Tensor | None
    """[L, T, K, D] fp32."""
    values: torch.Tensor | None
    """[L, T, K, Dv] fp32."""
    conv: torch.Tensor | None
    """[L, C, W] fp32: cotangent of the conv tail at the current sweep position."""
    recurrent: torch.Tensor | None
    """[L, H, Dk, Dv] fp32: cotangent of the recurrent state at the current sweep position."""
    latent: torch.Tensor | None = None
    """[L, T, R] fp32 cotangent of the MLA latents (GLM-5)."""
    rope_key: torch.Tensor | None = None
    """[L, T, E] fp32 cotangent of the MLA rope keys. Indexer keys have none (no_grad indexer)."""

    @classmethod
    def zeros_like_state(cls, state: PrefixState) -> PromptCotangent:
        if state.tiers is not None:
            return state.tiers.cotangent()  # per-token parts in the state's lower tier
        return cls.zeros_for(state, *state.final_linear_state_all())

    @classmethod
    def zeros_for(cls, state, final_conv, final_recurrent) -> PromptCotangent:
        """Zero fp32 cotangents of `state`'s per-token arrays (a whole state or a rank's slice)
        and of a linear-attention state shaped like `final_conv` [L, C, W] /
        `final_recurrent` [L, H, Dk, Dv] (None: no such layers)."""

        def zeros(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.zeros(t.shape, dtype=torch.float32, device=t.device)

        parts = {a.field: zeros(getattr(state, a.field)) for a in COTANGENT_ARRAYS if a.per_token}
        return cls(conv=zeros(final_conv), recurrent=zeros(final_recurrent), **parts)

    def nbytes(self) -> int:
        return nbytes(getattr(self, a.field) for a in COTANGENT_ARRAYS)


@dataclass
class BranchCache:
    """A `StateCache` for one replay plus the linear-attention leaves it forked (exact mode)."""

    cache: StateCache
    leaves: dict[int, tuple[torch.Tensor, torch.Tensor]]
    """Gated DeltaNet slot -> (conv tail [B, C, W], recurrent state [B, H, Dk, Dv]) forked from
    the final state, leaves of the branch's graph."""

    def add_leaf_grads_into(self, cotangent: PromptCotangent) -> None:
        """After backward: add the gradient of the forked final state into the cotangent."""
        for slot, (conv, recurrent) in self.leaves.items():
            if conv.grad is not None:
                cotangent.conv[slot] += conv.grad.float()
            if recurrent.grad is not None:
                cotangent.recurrent[slot] += recurrent.grad.float()


def branch_cache(
    state: PrefixState,
    cotangent: PromptCotangent | None = None,
    *,
    keep_branch: bool = False,
    batch_size: int = 1,
    branch_capacity: int = 0,
    exchange: PrefixExchange = LOCAL,
) -> BranchCache:
    """Layers that read the prompt state (this process's, or across the ranks as `exchange`
    says); with `cotangent`, collect this process's part of dS during backward.

    `keep_branch` (decoding): attention layers keep the rows' own K/V / latents between forwards
    (in buffers preallocated for `branch_capacity` tokens where the layers take one).
    """
    leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    layers = branch_layers(
        state,
        cotangent,
        leaves=leaves,
        batch_size=batch_size,
        kind_kwargs=exchange.layers.branch_kwargs(
            state, keep_branch=keep_branch, branch_capacity=branch_capacity
        ),
    )
    return BranchCache(StateCache(layers, position_offset=state.num_tokens), leaves)


def branch_input_ids(state: PrefixState, response_ids: torch.Tensor) -> torch.Tensor:
    """[R] the branch's input: the prompt's last token, then the response without its last token."""
    last = torch.tensor([state.last_token_id], dtype=torch.long, device=response_ids.device)
    return torch.cat([last, response_ids[:-1]])


def replay_logits(
    model: PreTrainedModel,
    state: PrefixState,
    input_ids_BR: torch.Tensor,
    cache: StateCache,
    exchange: PrefixExchange = LOCAL,
) -> torch.Tensor:
    """[B, R, V] logits of a branch forward at positions T .. T+R-1 on `cache`, its layers
    reading the prompt prefix as `exchange` says (this process's, or the ranks').

    With autograd, the Gated DeltaNet layers backpropagate through LongStraw's chunked delta
    rule (`longstraw.engine.delta_rule`; the forward stays transformers'), whose decay
    gradients keep fp32 accuracy.
    """
    batch, length = input_ids_BR.shape
    offset = cache.position_offset
    position_ids = torch.arange(offset, offset + length, device=model.device).expand(batch, -1)
    with (
        exchange.layers.attention_enabled(model),
        delta_rule_backward_recomputed(model, lambda: BLOCK_TOKENS),
    ):
        output = model(
            input_ids=input_ids_BR.to(model.device),
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            **{CACHE_KWARG: cache},
        )
    return output.logits


def token_logprobs(
    logits_BRV: torch.Tensor, targets_BR: torch.Tensor, temperature: float
) -> torch.Tensor:
    """[B, R] fp32 log-probs of `targets` under `logits / temperature` (TRL's convention)."""
    logp = torch.log_softmax(logits_BRV.float() / temperature, dim=-1)
    return logp.gather(-1, targets_BR.unsqueeze(-1).to(logp.device)).squeeze(-1)


def branch_logprobs(
    model: PreTrainedModel,
    state: PrefixState,
    response_ids: torch.Tensor | Sequence[int],
    *,
    temperature: float = 1.0,
    cotangent: PromptCotangent | None = None,
) -> torch.Tensor:
    """[R] fp32 log-probs of `response_ids` given the frozen prompt state.

    Works with and without autograd. With `cotangent` (exact mode) the backward of the returned
    log-probs also adds the prefix K/V cotangent into it; the linear-attention part needs the
    forked leaves, which `replay_branch` returns.
    """
    return replay_branch(model, state, response_ids, temperature=temperature, cotangent=cotangent)[
        0
    ]


def decoding_cache(
    state: PrefixState, exchange: PrefixExchange, *, batch_size: int, branch_capacity: int
) -> StateCache:
    """The cache a sampler decodes on: `batch_size` rows whose attention layers keep the rows'
    own K/V between forwards (buffers for `branch_capacity` tokens where the layers take one)."""
    return branch_cache(
        state, keep_branch=True, batch_size=batch_size, branch_capacity=branch_capacity,
        exchange=exchange,
    ).cache  # fmt: skip


def replay_branch(
    model: PreTrainedModel,
    state: PrefixState,
    response_ids: torch.Tensor | Sequence[int],
    *,
    temperature: float = 1.0,
    cotangent: PromptCotangent | None = None,
    exchange: PrefixExchange = LOCAL,
) -> tuple[torch.Tensor, BranchCache]:
    """(log-probs [R], the branch's cache): after backward, `cache.add_leaf_grads_into(cotangent)`
    adds the gradient of the forked linear-attention state (exact mode). On a sequence group
    every rank calls this with the same arguments (replicated) and gets the same bits."""
    vocab = model.config.get_text_config().vocab_size
    response = as_token_tensor(response_ids, what="response_ids", vocab_size=vocab).to(model.device)
    check_positions(state.spec, state.prompt_len + response.numel(), what="prompt + response")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    forked = branch_cache(state, cotangent, exchange=exchange)
    logits = replay_logits(
        model, state, branch_input_ids(state, response).unsqueeze(0), forked.cache, exchange
    )
    return token_logprobs(logits, response.unsqueeze(0), temperature)[0], forked
