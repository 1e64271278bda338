"""Tiny and small random-weight checkpoints of every supported family, written as real HF directories.

Tests and the demo never download a model: they build one from a `transformers` config here, save
it with `save_pretrained` (config.json, model.safetensors, generation_config.json) plus a locally
trained byte-level BPE tokenizer, and load it back through `load_checkpoint`, the same path a
user's checkpoint takes.

`tiny` is for tests: hidden 64, a few layers, and every layer kind of its family is present
(Gated DeltaNet and gated full attention; dense and MoE MLPs; for GLM-5 an `index_topk` of 32,
well below test prompt lengths, so DSA runs in its sparse regime). `small` is for benchmarks:
hidden 512, 8 layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from longstraw.models.checkpoint import write_checkpoint_metadata
from longstraw.models.tokenizer import build_hf_tokenizer, save_tokenizer

Family = Literal["llama", "qwen3", "qwen3_5", "qwen3_next", "glm_moe_dsa"]
Size = Literal["tiny", "small"]
FAMILIES: tuple[str, ...] = ("llama", "qwen3", "qwen3_5", "qwen3_next", "glm_moe_dsa")
SIZES: tuple[str, ...] = ("tiny", "small")

_VOCAB = {"tiny": 512, "small": 2048}
MAX_POSITIONS = 4_194_304 + 4096
"""Positions a built checkpoint accepts: the longest synthetic prompt plus a response."""
_EOS_ID = 0  # the tokenizer's first special token, <|endoftext|>


def _dense_fields(size: Size) -> dict:
    if size == "tiny":
        return dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    return dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    )


def _linear_attention_fields(size: Size) -> dict:
    if size == "tiny":
        # One full-attention layer in every two so both kinds appear in a 4-layer model.
        return dict(
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"] * 2,
        )
    # Qwen3.5's own ratio: three Gated DeltaNet layers per full-attention layer.
    return dict(
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    )


def build_config(family: Family, size: Size = "tiny") -> PretrainedConfig:
    """A transformers config of `family` at `size` (random-weight checkpoints for tests/benchmarks)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    common = dict(
        vocab_size=_VOCAB[size],
        # Random weights have no trained position range; the limit is the synthetic task's longest
        # prompt (HaystackTaskConfig.num_prompt_tokens), so million-token runs pass check_positions.
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=_EOS_ID,
        pad_token_id=_EOS_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if family in ("llama", "qwen3"):
        return AutoConfig.for_model(family, **common, **_dense_fields(size))
    if family == "qwen3_5":
        # The text-only causal LM (model_type "qwen3_5_text"), which AutoModelForCausalLM maps to
        # Qwen3_5ForCausalLM; partial_rotary_factor 0.25 is Qwen3.5's own.
        rope = {**common.pop("rope_parameters"), "partial_rotary_factor": 0.25}
        return AutoConfig.for_model(
            "qwen3_5_text",
            **common,
            rope_parameters=rope,
            **_dense_fields(size),
            **_linear_attention_fields(size),
        )
    if family == "qwen3_next":
        rope = {**common.pop("rope_parameters"), "partial_rotary_factor": 0.25}
        moe = (
            dict(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=64,
            )
            if size == "tiny"
            else dict(
                num_experts=16,
                num_experts_per_tok=4,
                moe_intermediate_size=256,
                shared_expert_intermediate_size=512,
            )
        )
        return AutoConfig.for_model(
            "qwen3_next",
            **common,
            rope_parameters=rope,
            **_dense_fields(size),
            **_linear_attention_fields(size),
            **moe,
            decoder_sparse_step=1,
            # Layer 0 keeps a dense MLP so both MLP kinds are exercised.
            mlp_only_layers=[0],
        )
    # glm_moe_dsa: MLA + DSA indexer + MoE. v_head_dim = qk_nope + qk_rope as in the real model
    # (otherwise CPU attention takes a slow materialising path).
    if size == "tiny":
        mla = dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=24,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            index_topk=32,
            index_head_dim=16,
            index_n_heads=2,
            # layer 0 computes its own top-k, later layers reuse it: both indexer kinds present.
            indexer_types=["full", "shared", "full"],
        )
    else:
        mla = dict(
            hidden_size=512,
            intermediate_size=1536,
            moe_intermediate_size=256,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
            kv_lora_rank=128,
            q_lora_rank=256,
            qk_rope_head_dim=32,
            qk_nope_head_dim=64,
            v_head_dim=96,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            index_topk=512,
            index_head_dim=64,
            index_n_heads=4,
        )
    return AutoConfig.for_model("glm_moe_dsa", **common, **mla)


def init_model(
    family: Family,
    size: Size,
    out_dir: str | Path,
    *,
    seed: int = 42,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random-weight checkpoint of `family`/`size` to `out_dir`; returns the directory.

    The directory holds what `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
    load unchanged, plus `longstraw.json` (weights digest, policy version 0).
    """
    return write_random_checkpoint(build_config(family, size), out_dir, seed=seed, dtype=dtype)


def write_random_checkpoint(
    config: PretrainedConfig,
    out_dir: str | Path,
    *,
    seed: int = 42,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random-weight checkpoint of any `config` (one of `build_config`'s, or one derived
    from it) to `out_dir` the way `init_model` does; returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=_EOS_ID, pad_token_id=_EOS_ID, bos_token_id=None, do_sample=True
    )
    model.save_pretrained(str(out))
    tokenizer = build_hf_tokenizer(vocab_size=config.vocab_size, seed=0)
    assert len(tokenizer) <= config.vocab_size, (len(tokenizer), config.vocab_size)
    save_tokenizer(tokenizer, out)
    write_checkpoint_metadata(out, policy_version=0)
    return out


def describe_checkpoint(path: str | Path) -> dict:
    """Small summary of a checkpoint directory (family, layers, parameters) for CLI output."""
    config = json.loads((Path(path) / "config.json").read_text())
    return {
        "model_type": config.get("model_type"),
        "hidden_size": config.get("hidden_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "layer_types": config.get("layer_types"),
        "vocab_size": config.get("vocab_size"),
    }
