"""Per-family adapters: which state each layer of a transformers model keeps for later tokens.

An adapter reads a model's config and answers one question: for every decoder layer, what must
survive the prompt so that later tokens compute exactly what a full forward would? Full-attention
layers keep K/V after RoPE and norms; Gated DeltaNet layers keep their conv tail and fp32
recurrent state. The engine allocates, forks and sweeps the state from this description alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedModel

from longstraw.models.lora import unwrapped

SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen3",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_next",
    "glm_moe_dsa",
)


@dataclass(frozen=True)
class FullAttentionSpec:
    """Full-attention layers: per-token K/V, stored as [layer, token, kv_head, head_dim]."""

    layer_indices: tuple[int, ...]
    """Model layer index of each stored layer, in storage order."""
    num_kv_heads: int
    head_dim: int
    value_head_dim: int


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet layers: constant-size state, checkpointed at every shard boundary."""

    layer_indices: tuple[int, ...]
    conv_dim: int
    """Channels of the depthwise causal conv (2 × key_dim + value_dim)."""
    conv_tail: int
    """Inputs the conv needs from before a shard: kernel - 1."""
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int


@dataclass(frozen=True)
class MlaSpec:
    """MLA layers (GLM-5): per-token latent, rope key and DSA indexer key, [layer, token, dim]."""

    layer_indices: tuple[int, ...]
    kv_lora_rank: int
    """Latent width R (after `kv_a_layernorm`)."""
    rope_dim: int
    """Shared rope key width (`qk_rope_head_dim`)."""
    index_head_dim: int
    """Indexer key width."""
    indexer_layer_indices: tuple[int, ...]
    """Layers with their own indexer (`indexer_types` "full"); `shared` layers reuse a selection."""

    def indexer_slot(self, layer_idx: int) -> int:
        return self.indexer_layer_indices.index(layer_idx)


@dataclass(frozen=True)
class StateSpec:
    """Everything the engine needs to know about a model's per-layer prompt state."""

    model_type: str
    num_layers: int
    full_attention: FullAttentionSpec | None
    linear_attention: LinearAttentionSpec | None
    max_positions: int | None
    """Largest position the model can address, or None when RoPE scaling extends it."""
    mla: MlaSpec | None = None

    def full_attention_slot(self, layer_idx: int) -> int:
        assert self.full_attention is not None
        return self.full_attention.layer_indices.index(layer_idx)

    def linear_attention_slot(self, layer_idx: int) -> int:
        assert self.linear_attention is not None
        return self.linear_attention.layer_indices.index(layer_idx)

    def mla_slot(self, layer_idx: int) -> int:
        assert self.mla is not None
        return self.mla.layer_indices.index(layer_idx)


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    return getattr(config, "text_config", None) or config


def _max_positions(config: PretrainedConfig) -> int | None:
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", None):
        # yarn / linear / dynamic scaling: the model is meant to run past max_position_embeddings.
        return None
    return getattr(config, "max_position_embeddings", None)


def state_spec(model_or_config: PreTrainedModel | PretrainedConfig) -> StateSpec:
    """The per-layer state description of a supported model; ValueError naming the supported ones."""
    config = getattr(model_or_config, "config", model_or_config)
    config = _text_config(config)
    model_type = config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by LongStraw's engine; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    num_layers = config.num_hidden_layers
    if model_type == "glm_moe_dsa":
        mla = MlaSpec(
            layer_indices=tuple(range(num_layers)),
            kv_lora_rank=config.kv_lora_rank,
            rope_dim=config.qk_rope_head_dim,
            index_head_dim=config.index_head_dim,
            indexer_layer_indices=tuple(
                i for i, kind in enumerate(config.indexer_types) if kind == "full"
            ),
        )
        return StateSpec(model_type, num_layers, None, None, _max_positions(config), mla)
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
    full = tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    linear = tuple(i for i, kind in enumerate(layer_types) if kind == "linear_attention")
    unknown = {kind for kind in layer_types if kind not in ("full_attention", "linear_attention")}
    if unknown:
        raise ValueError(f"layer types {sorted(unknown)} of {model_type} are not supported")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    full_spec = (
        FullAttentionSpec(full, config.num_key_value_heads, head_dim, head_dim) if full else None
    )
    linear_spec = None
    if linear:
        key_dim = config.linear_key_head_dim * config.linear_num_key_heads
        value_dim = config.linear_value_head_dim * config.linear_num_value_heads
        linear_spec = LinearAttentionSpec(
            layer_indices=linear,
            conv_dim=2 * key_dim + value_dim,
            conv_tail=config.linear_conv_kernel_dim - 1,
            num_value_heads=config.linear_num_value_heads,
            key_head_dim=config.linear_key_head_dim,
            value_head_dim=config.linear_value_head_dim,
        )
    return StateSpec(model_type, num_layers, full_spec, linear_spec, _max_positions(config))


def decoder_of(model: PreTrainedModel) -> torch.nn.Module:
    """The base (decoder) model under a causal-LM head: runs layers + final norm, no lm_head
    (of the transformers model itself when `model` is peft's wrapper of it)."""
    model = unwrapped(model)
    return getattr(model, model.base_model_prefix)


def attention_scales(model: PreTrainedModel) -> dict[int, float]:
    """Each attention module's softmax scale by decoder layer: what transformers hands the
    attention function as `scaling`, and what a rank answering another rank's queries for that
    layer scales them by."""
    return {
        m.layer_idx: m.scaling
        for m in model.modules()
        if hasattr(m, "layer_idx") and isinstance(getattr(m, "scaling", None), float)
    }
