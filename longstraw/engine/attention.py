"""The attention function LongStraw registers with transformers, and the switch that selects it.

transformers calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask,
scaling=..., **kwargs)` after the cache has handed back this forward's K/V. Extra keyword
arguments given to `model(...)` reach this function, so the engine passes its `StateCache` as
`longstraw_cache` and the function finds the prefix of `module.layer_idx` there: a log-sum-exp
merge of a prefix partial attention and a causal branch partial attention, no prefix copy.
Registered under a name with no mask function, so transformers builds no [S, T] mask at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from transformers import AttentionInterface, PreTrainedModel

from longstraw.engine import first_pass
from longstraw.models.glm import is_glm, mla_attention_installed
from longstraw.models.stable_routing import stable_routing_installed
from longstraw.ops.decode_attention import decode_attention
from longstraw.ops.prefix_attention import prefix_attention_outputs, prefix_cached_attention

ATTENTION_NAME = "longstraw_prefix"
CACHE_KWARG = "longstraw_cache"
# Prefix keys per attention chunk: bounds the score block to [B, H, R, 1024] during replay; also
# the grid a streamed prompt state is read on (`longstraw.engine.state_tiers`). Read at call time.
PREFIX_CHUNK_TOKENS = 1024


def prefix_chunk_tokens(model: PreTrainedModel) -> int:
    """Prefix positions per chunk of `model`'s attention kernels (GLM's latent attention and
    indexer have their own constant): the unit a streamed prompt state is read in."""
    if is_glm(model):
        from longstraw.models import glm

        return glm.PREFIX_CHUNK_TOKENS
    return PREFIX_CHUNK_TOKENS


def longstraw_attention(
    module: torch.nn.Module,
    query_BHSD: torch.Tensor,
    key_BKSD: torch.Tensor,
    value_BKSD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    cache = kwargs.get(CACHE_KWARG)
    if cache is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} needs `{CACHE_KWARG}=` in the forward call; "
            "run the model through longstraw.engine, or switch the model back to 'sdpa'"
        )
    layer = cache.layers[module.layer_idx]
    scale = scaling if scaling is not None else query_BHSD.shape[-1] ** -0.5
    # Decoding (the layer keeps the rows' own K/V between steps, or a few new queries meet a
    # longer overlay) runs without autograd and reads the prefix once for all rows.
    decoding = layer.keep_branch or key_BKSD.shape[2] != query_BHSD.shape[2]
    ranks = layer.ranks
    if decoding and ranks is not None and not ranks.replicated:
        raise RuntimeError(
            "decoding over a sequence-sharded prefix runs replicated and without autograd "
            "(engine.rollout over CrossRankExchange); replay the sampled responses for gradients"
        )
    if not decoding:
        # A long branch's earlier segments (engine/segmented_replay.py), else None.
        extra_prefix = getattr(layer, "extra_prefix", None)
        inputs = (query_BHSD, key_BKSD, value_BKSD, layer.prefix_k_TKD, layer.prefix_v_TKD)
        outputs = None
        kept = first_pass.active()
        if kept is not None and torch.is_grad_enabled():
            outputs = kept.kept_or_computed(
                module,
                lambda: prefix_attention_outputs(
                    *inputs, scale=scale, chunk_size=PREFIX_CHUNK_TOKENS,
                    extra_prefix=extra_prefix, ranks=ranks,
                ),
            )  # fmt: skip
        out_BHSD = prefix_cached_attention(
            *inputs,
            scale=scale,
            chunk_size=PREFIX_CHUNK_TOKENS,
            prefix_grad_k_TKD=layer.grad_k_TKD,
            prefix_grad_v_TKD=layer.grad_v_TKD,
            extra_prefix=extra_prefix,
            outputs=outputs,
            ranks=ranks,
        )
    else:
        out_BHSD = decode_attention(
            query_BHSD,
            key_BKSD,
            value_BKSD,
            layer.prefix_k_TKD,
            layer.prefix_v_TKD,
            scale=scale,
            chunk_size=PREFIX_CHUNK_TOKENS,
            ranks=ranks,
        )
    return out_BHSD.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, longstraw_attention)


@contextlib.contextmanager
def attention_selected(
    model: PreTrainedModel,
    name: str,
    layers_installed: Callable[[PreTrainedModel], contextlib.AbstractContextManager],
) -> Iterator[None]:
    """Inside the block `model`'s attention calls the function registered as `name`, with what
    `layers_installed(model)` installs (GLM-5's attention modules, replaced whole). Nested
    blocks (the sweep's per-layer recomputation, a sampler's steps) change nothing."""
    config = model.config
    previous = config._attn_implementation
    if previous == name:
        yield
        return
    config._attn_implementation = name
    try:
        with layers_installed(model):
            yield
    finally:
        config._attn_implementation = previous


@contextlib.contextmanager
def _prefix_layers_installed(model: PreTrainedModel) -> Iterator[None]:
    family = mla_attention_installed(model) if is_glm(model) else contextlib.nullcontext()
    with family, stable_routing_installed(model):
        yield


def prefix_attention_enabled(model: PreTrainedModel) -> contextlib.AbstractContextManager:
    """Run `model`'s attention layers through LongStraw's prefix attention inside the block."""
    return attention_selected(model, ATTENTION_NAME, _prefix_layers_installed)
