"""Prefill: run `prompt[:-1]` through the model once, shard by shard, without autograd.

Each shard is an ordinary transformers forward of `shard_tokens` tokens at their true positions.
Its queries attend to the state of earlier shards through the prefix attention (no concatenation),
its new K/V are written straight into the preallocated state, and the Gated DeltaNet layers start
from the previous shard's conv tail and recurrent state and leave theirs as the next checkpoint.
Activations live for one shard; nothing of size P × hidden outlives it.

`torch.no_grad()`, not `inference_mode`: inference tensors cannot be saved for backward, and
every branch replay saves the prefix state's views for its backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from longstraw.engine.attention import CACHE_KWARG, prefix_attention_enabled
from longstraw.engine.cache import StateCache
from longstraw.engine.layer_kinds import prefill_layers
from longstraw.engine.state import PrefixState
from longstraw.engine.validation import as_token_tensor, check_positions
from longstraw.models.adapters import decoder_of, state_spec

ShardCallback = Callable[[PrefixState, int], None]


def _shard_cache(state: PrefixState, shard: int) -> StateCache:
    """Layers that read the state before `shard` and write this shard's part of it."""
    start, end = state.bounds[shard]
    layers = prefill_layers(state, prefix_end=start, rows=slice(start, end), checkpoint=shard)
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
) -> PrefixState:
    """The prompt state of `prompt_ids[:-1]`, computed `shard_tokens` tokens at a time.

    `on_shard(state, k)` runs after shard k is complete (persistence, progress). To resume an
    interrupted prefill, pass the partially filled `resume` state and the first missing shard as
    `start_shard`: shards before it are not recomputed. `end_shard` stops before that shard
    (one task per shard computes `start_shard = k, end_shard = k + 1`).
    """
    spec = state_spec(model)
    ids = as_token_tensor(
        prompt_ids, what="prompt_ids", vocab_size=model.config.get_text_config().vocab_size
    )
    check_positions(spec, ids.numel(), what="the prompt")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    dtype = next(model.parameters()).dtype
    if resume is None:
        if start_shard != 0:
            raise ValueError("start_shard > 0 needs the partially filled state as `resume=`")
        state = PrefixState.allocate(
            spec,
            prompt_ids=ids,
            shard_tokens=shard_tokens,
            dtype=dtype,
            device=model.device,
        )
    else:
        state = resume
        if not torch.equal(state.prompt_ids, ids.cpu()) or state.shard_tokens != shard_tokens:
            raise ValueError(
                "the state to resume was computed for another prompt or shard size "
                f"(shard_tokens {state.shard_tokens} vs {shard_tokens}); start a fresh prefill"
            )
    with torch.no_grad(), prefix_attention_enabled(model):
        for shard in range(start_shard, state.num_shards if end_shard is None else end_shard):
            start, end = state.bounds[shard]
            run_shard_forward(model, ids, _shard_cache(state, shard), start, end)
            if on_shard is not None:
                on_shard(state, shard)
    return state
