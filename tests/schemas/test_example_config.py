"""The example run config shipped in the README stays valid."""

from __future__ import annotations

from pathlib import Path

from longstraw.schemas.run import load_run_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "run.yaml"


def test_example_run_config_loads_with_its_settings():
    config = load_run_config(EXAMPLE)
    assert config.run_id == "haystack-4k"
    assert config.engine.prompt_grad == "exact"
    assert config.data.task.num_prompt_tokens == 4096
    # 4095 state tokens in 1024-token shards: four shards, the last one short.
    assert config.engine.shard_tokens == 1024
    assert config.grpo.epsilon_high == 0.28
