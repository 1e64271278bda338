"""`init_model` checkpoints: every family and size loads in transformers unchanged and runs a
forward; tiny configs mix every layer kind of their family; the weights digest is recorded once
and is stable.

Legend: P prompt tokens, V vocab.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from longstraw.models.checkpoint import (
    metadata_record_path,
    read_checkpoint_metadata,
    weights_digest_of,
)
from longstraw.models.factory import FAMILIES, SIZES, build_config, init_model

SEED = 42
# The shortest prompt the engine tests use with GLM in the sparse DSA regime (P = 63).
SHORTEST_SPARSE_TEST_PROMPT = 63
HF_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_init_model_loads_in_transformers_and_runs_a_forward(family, size, checkpoint_dir):
    path = checkpoint_dir(family, size)
    for name in HF_FILES:
        assert (path / name).exists(), f"{family}/{size} checkpoint lacks {name}"
    model = AutoModelForCausalLM.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert len(tokenizer) <= model.config.vocab_size
    assert tokenizer.eos_token_id == model.config.eos_token_id
    ids = tokenizer("The value of key 42 is 7.", return_tensors="pt").input_ids  # [1, P]
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [1, P, V]
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_small_size_is_benchmark_sized(family):
    config = build_config(family, "small")
    assert 512 <= config.hidden_size <= 1024, config.hidden_size
    assert 8 <= config.num_hidden_layers <= 12, config.num_hidden_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_size_is_test_sized(family):
    config = build_config(family, "tiny")
    assert config.hidden_size <= 128
    assert config.num_hidden_layers <= 4


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("size", SIZES)
def test_hybrid_configs_mix_linear_and_full_attention(family, size):
    config = build_config(family, size)
    assert set(config.layer_types) == {"linear_attention", "full_attention"}
    assert len(config.layer_types) == config.num_hidden_layers


@pytest.mark.parametrize("size", SIZES)
def test_qwen3_next_mixes_dense_and_moe_mlps(size):
    config = build_config("qwen3_next", size)
    moe_layers = [
        i
        for i in range(config.num_hidden_layers)
        if i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0
    ]
    assert config.num_experts > config.num_experts_per_tok >= 1
    assert moe_layers and len(moe_layers) < config.num_hidden_layers


def test_tiny_qwen3_next_model_has_both_mlp_kinds(load_tiny):
    model = load_tiny("qwen3_next")
    kinds = {type(layer.mlp).__name__ for layer in model.model.layers}
    assert len(kinds) == 2, kinds


@pytest.mark.parametrize("size", SIZES)
def test_glm_mixes_dense_and_moe_mlps(size):
    config = build_config("glm_moe_dsa", size)
    assert 1 <= config.first_k_dense_replace < config.num_hidden_layers
    assert config.n_routed_experts > config.num_experts_per_tok >= 1


def test_tiny_glm_has_both_indexer_kinds_and_a_sparse_topk():
    config = build_config("glm_moe_dsa", "tiny")
    assert set(config.indexer_types) == {"full", "shared"}
    assert config.indexer_types[0] == "full"  # a shared layer reuses an earlier full one's top-k
    assert config.index_topk < SHORTEST_SPARSE_TEST_PROMPT, config.index_topk
    # v_head_dim = qk_nope + qk_rope keeps CPU attention off its materialising path.
    assert config.v_head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim


def test_tiny_glm_model_has_both_mlp_kinds(load_tiny):
    model = load_tiny("glm_moe_dsa")
    kinds = {type(layer.mlp).__name__ for layer in model.model.layers}
    assert len(kinds) == 2, kinds


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dense_families_use_grouped_query_attention(family):
    config = build_config(family, "tiny")
    assert config.num_key_value_heads < config.num_attention_heads


def test_unknown_family_or_size_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="unknown family 'gpt2'; choose one of llama"):
        build_config("gpt2", "tiny")
    with pytest.raises(ValueError, match="unknown size 'huge'; choose one of tiny, small"):
        build_config("llama", "huge")


def test_weights_digest_is_recorded_and_matches_the_files(checkpoint_dir):
    path = checkpoint_dir("llama")
    meta = read_checkpoint_metadata(path)
    assert meta.policy_version == 0
    assert meta.weights_digest == weights_digest_of(path)
    assert json.loads((path / "longstraw.json").read_text())["weights_digest"] == (
        meta.weights_digest
    )


def test_same_seed_gives_the_same_digest_and_another_seed_does_not(tmp_path, checkpoint_dir):
    again = init_model("llama", "tiny", tmp_path / "again", seed=SEED)
    other = init_model("llama", "tiny", tmp_path / "other", seed=SEED + 1)
    reference = read_checkpoint_metadata(checkpoint_dir("llama")).weights_digest
    assert read_checkpoint_metadata(again).weights_digest == reference
    assert read_checkpoint_metadata(other).weights_digest != reference


def test_user_checkpoint_without_metadata_is_recorded_outside_its_directory(tmp_path):
    path = init_model("llama", "tiny", tmp_path / "user", seed=SEED)
    expected = weights_digest_of(path)
    (path / "longstraw.json").unlink()
    before = sorted((f.name, f.stat().st_mtime_ns) for f in path.iterdir())
    records = tmp_path / "root" / "model-records"
    meta = read_checkpoint_metadata(path, record_dir=records)
    assert (meta.weights_digest, meta.policy_version) == (expected, 0)
    assert sorted((f.name, f.stat().st_mtime_ns) for f in path.iterdir()) == before
    record = metadata_record_path(path, records)
    assert json.loads(record.read_text())["metadata"]["weights_digest"] == expected
    # The record is what a second read uses: a forged digest in it comes back...
    body = json.loads(record.read_text())
    body["metadata"]["weights_digest"] = "f" * 64
    record.write_text(json.dumps(body))
    assert read_checkpoint_metadata(path, record_dir=records).weights_digest == "f" * 64
    # ...until the weights file changes (another size or modification time): hashed again.
    weights = path / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert read_checkpoint_metadata(path, record_dir=records).weights_digest == expected
    assert json.loads(record.read_text())["metadata"]["weights_digest"] == expected


def test_bfloat16_checkpoint_loads_as_bfloat16(tmp_path):
    path = init_model("qwen3_5", "tiny", tmp_path / "bf16", seed=SEED, dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert model.dtype == torch.bfloat16


def test_built_checkpoints_accept_a_two_million_token_prompt_and_its_response():
    # The tiny/small configs once said 131072 positions: a 128K-token prompt plus its response
    # failed check_positions in prefill and rollout.
    from longstraw.engine.validation import check_positions
    from longstraw.models.adapters import state_spec

    for family in ("qwen3_5", "glm_moe_dsa"):
        spec = state_spec(build_config(family, "tiny"))
        check_positions(spec, 2_200_000 + 16, what="prompt + response")
        with pytest.raises(ValueError, match="max_position_embeddings"):
            check_positions(spec, 4_194_304 + 4097, what="prompt + response")
