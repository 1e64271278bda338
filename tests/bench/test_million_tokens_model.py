"""bench_million_tokens.py's `--model narrow` checkpoint: a valid hybrid, written like `init-model`'s."""

from __future__ import annotations

import argparse
import json


def test_narrow_checkpoint_has_one_single_head_attention_layer_among_delta_net_layers(
    tmp_path, bench_script
):
    from transformers import AutoModelForCausalLM

    bench = bench_script("bench_million_tokens")
    path = bench.build_model(argparse.Namespace(model="narrow", work=tmp_path))
    assert path == tmp_path / "model-narrow"
    config = json.loads((path / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (1, 1)
    assert (path / "longstraw.json").exists() and (path / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(str(path))
    attention = model.model.layers[3].self_attn
    # Gated attention: the query projection carries the gate too.
    assert attention.q_proj.out_features == 2 * config["head_dim"]
    assert attention.k_proj.out_features == config["head_dim"]
    assert not hasattr(model.model.layers[0], "self_attn")
