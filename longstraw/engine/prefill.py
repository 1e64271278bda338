"""Prefill: run `prompt[:-1]` through the model once, shard by shard, without autograd.

Each shard is an ordinary transformers forward of `shard_tokens` tokens at their true positions.
Its queries attend to the state of earlier shards through the prefix attention (no concatenation),
its new K/V are written straight into the preallocated state, and the Gated DeltaNet layers start
from the previous shard's conv tail and recurrent state and leave theirs as the next checkpoint.
Activations live for one shard; nothing of size P × hidden outlives it.

`torch.no_grad()`, not `inference_mode`: inference tensors cannot be saved for backward, and
every branch replay saves the prefix state's views for its backward.

One prefill at every world size. On a sequence group each rank computes the shards it holds
(`PrefixState.placement`) while the others serve the partials of their earlier positions; at an
ownership boundary the previous owner hands over the linear-attention state, and at the end the
final state goes to every rank. The `PrefixExchange` supplies what differs; one process owns
every shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from longstraw.engine.attention import CACHE_KWARG
from longstraw.engine.cache import StateCache
from longstraw.engine.exchange import LOCAL, PrefixExchange
from longstraw.engine.layer_kinds import prefill_layers
from longstraw.engine.state import PrefixState
from longstraw.engine.validation import as_token_tensor, check_positions
from longstraw.models.adapters import decoder_of, state_spec

ShardCallback = Callable[[PrefixState, int], None]


def prefill_cache(state: PrefixState, shard: int, kind_kwargs: dict | None = None) -> StateCache:
    """Layers that read the state before `shard` and write this shard's part of it (on the
    process that holds `shard`; `kind_kwargs` as in `layer_kinds.prefill_layers`)."""
    start, end = state.bounds[shard]
    layers = prefill_layers(
        state,
        prefix_end=state.local_prefix_end(shard),
        rows=state.local_rows(start, end),
        checkpoint=state.local_checkpoint(shard),
        kind_kwargs=kind_kwargs,
    )
    return StateCache(layers, position_offset=start)


def run_shard_forward(
    model: PreTrainedModel, prompt_ids: torch.Tensor, cache: StateCache, start: int, end: int
) -> torch.Tensor:
    """The decoder forward of prompt positions [start, end) on `cache` (no lm_head)."""
    device = model.device
    input_ids = prompt_ids[start:end].to(device).unsqueeze(0)
    position_ids = torch.arange(start, end, device=device).unsqueeze(0)
    output = decoder_of(model)(
        input_ids=input_ids,
        position_ids=position_ids,
        cache=cache,
        use_cache=True,
        **{CACHE_KWARG: cache},
    )
    return output.last_hidden_state


def prefill(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor | Sequence[int],
    *,
    shard_tokens: int,
    on_shard: ShardCallback | None = None,
    resume: PrefixState | None = None,
    start_shard: int = 0,
    end_shard: int | None = None,
    exchange: PrefixExchange = LOCAL,
) -> PrefixState:
    """The prompt state of `prompt_ids[:-1]` (this process's part of it: on a sequence group
    call on every rank together), computed `shard_tokens` tokens at a time.

    `on_shard(state, k)` runs after shard k is complete, on the process that holds it
    (persistence, progress). To resume an interrupted prefill, pass the partially filled
    `resume` state and the first missing shard as `start_shard` (the same on every rank): shards
    before it are not recomputed, only the linear-state hand-overs at their ownership boundaries
    are replayed (one constant-size broadcast each). `end_shard` (None: all) stops before that
    shard (one task per shard computes `start_shard = k, end_shard = k + 1`); the final linear
    state reaches every rank once the last shard is done.
    """
    ids = prompt_tensor(model, prompt_ids)
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    state = prefill_target(
        model, ids, shard_tokens=shard_tokens, resume=resume, start_shard=start_shard,
        exchange=exchange,
    )  # fmt: skip
    stop = state.num_shards if end_shard is None else end_shard
    if not start_shard <= stop <= state.num_shards:
        raise ValueError(
            f"end_shard {end_shard} must lie in [start_shard, num_shards] = "
            f"[{start_shard}, {state.num_shards}]"
        )
    with torch.no_grad(), exchange.layers.attention_enabled(model):
        for shard in range(stop):
            if shard > 0 and state.owner_of(shard - 1) != state.owner_of(shard):
                # Also at restored boundaries: the start state of a rank's first shard is the
                # previous owner's end state, which that rank did not restore itself.
                exchange.shards.hand_over_start_state(state, shard)
            if shard < start_shard:
                continue
            if state.owner_of(shard) == state.rank:
                start, end = state.bounds[shard]
                cache = prefill_cache(state, shard, exchange.layers.owner_kwargs(state, shard))
                run_shard_forward(model, ids, cache, start, end)
                exchange.shards.finish_owned_shard(state)
                if on_shard is not None:
                    on_shard(state, shard)
            else:
                exchange.shards.serve_shard(model, state, shard, None, None)
        if stop == state.num_shards:
            exchange.shards.share_final_state(state)
    return state


def prompt_tensor(model: PreTrainedModel, prompt_ids) -> torch.Tensor:
    """[P] int64 prompt ids, checked against the model's vocabulary and positions."""
    ids = as_token_tensor(
        prompt_ids, what="prompt_ids", vocab_size=model.config.get_text_config().vocab_size
    )
    check_positions(state_spec(model), ids.numel(), what="the prompt")
    return ids


def allocate_prompt_state(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor | Sequence[int],
    *,
    shard_tokens: int,
    exchange: PrefixExchange = LOCAL,
    device: torch.device | str | None = None,
) -> PrefixState:
    """This process's empty part of the prompt state (what `prefill` fills), on `device`
    (None: the model's; "meta": shapes only, for a tiered state)."""
    return PrefixState.allocate(
        state_spec(model),
        prompt_ids=prompt_tensor(model, prompt_ids),
        shard_tokens=shard_tokens,
        placement=exchange.shards.placement(),
        dtype=next(model.parameters()).dtype,
        device=model.device if device is None else device,
    )


def prefill_target(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    *,
    shard_tokens: int,
    resume: PrefixState | None,
    start_shard: int,
    exchange: PrefixExchange = LOCAL,
) -> PrefixState:
    """The state a prefill fills: fresh, or `resume` checked against the arguments."""
    if resume is None:
        if start_shard != 0:
            raise ValueError("start_shard > 0 needs the partially filled state as `resume=`")
        return allocate_prompt_state(
            model, prompt_ids, shard_tokens=shard_tokens, exchange=exchange
        )
    if not torch.equal(resume.prompt_ids, prompt_ids.cpu()) or resume.shard_tokens != shard_tokens:
        raise ValueError(
            "the state to resume was computed for another prompt or shard size "
            f"(shard_tokens {resume.shard_tokens} vs {shard_tokens}); start a fresh prefill"
        )
    return resume
