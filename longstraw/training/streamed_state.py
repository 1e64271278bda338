"""The prompt state under `engine.state_budget_bytes` in the stages, and replay from a committed
state without loading it (its K/V or latents stream chunk by chunk).

`budgeted_state` is what the no-grad stages (rollout, scoring) read; the backward stage tiers
its state inside `accumulate_group_gradients`. `tier_committed_state` joins
`longstraw.storage.streamed_state` (the Zarr chunks as a lower tier, checksummed as read) and
`longstraw.engine.state_tiers` (the resident budget and the streaming).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from longstraw.engine.layer_kinds import state_array_by_storage_name
from longstraw.engine.state import PrefixState, shard_bounds
from longstraw.engine.state_tiers import TieredState, tiered_for_group, tiered_from_sources
from longstraw.models.adapters import state_spec
from longstraw.storage.streamed_state import StreamedCommittedState


@contextlib.contextmanager
def budgeted_state(engine, model: PreTrainedModel, state: PrefixState) -> Iterator[PrefixState]:
    """`state`, tiered under `engine.state_budget_bytes` (an `EngineConfig`; None: itself) for
    the block: what rollout and scoring read, no cotangent. Tokens and log-probs are bitwise
    those of the resident state (same kernels, same chunk grid)."""
    with tiered_for_group(
        model, state, engine.state_budget_bytes, engine.state_tier, engine.state_dir, exact=False
    ) as tiered:
        yield tiered


def tier_committed_state(
    model: PreTrainedModel,
    streamed: StreamedCommittedState,
    prompt_ids: torch.Tensor,
    *,
    budget_bytes: int,
    lower: str = "host",
    directory: str | None = None,
    exact: bool = True,
) -> TieredState:
    """A tiered `PrefixState` (`longstraw.engine.state_tiers`) whose K/V or latents stream from
    the committed Zarr state; the cotangents (exact mode) live in the `lower` tier."""
    prompt_ids = torch.as_tensor(prompt_ids).cpu()
    if prompt_ids.numel() - 1 != streamed.ref.num_tokens:
        raise ValueError(
            f"the committed state covers {streamed.ref.num_tokens} tokens but the prompt has "
            f"{prompt_ids.numel()} (expected {streamed.ref.num_tokens + 1}); pass its prompt"
        )
    base = PrefixState(
        state_spec(model),
        prompt_ids,
        streamed.shard_tokens,
        shard_bounds(prompt_ids.numel() - 1, streamed.shard_tokens),
        None,
        None,
        streamed.checkpoints.get("linear_attention/conv"),
        streamed.checkpoints.get("linear_attention/recurrent"),
    )
    sources = {
        state_array_by_storage_name(name).field: source
        for name, source in streamed.token_tiers.items()
    }
    return tiered_from_sources(
        model,
        base,
        sources,
        budget_bytes=budget_bytes,
        lower=lower,
        directory=directory,
        exact=exact,
    )
