"""RunConfig from YAML: defaults, and `ConfigError`s that name the file and each bad field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from longstraw.schemas.run import (
    ConfigError,
    EngineConfig,
    HaystackDataConfig,
    JsonlDataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    load_run_config,
)


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_an_explicit_empty_mapping_gives_the_embedded_default(tmp_path):
    # An empty *file* is refused (tests/schemas/test_override_errors.py); `{}` asks for defaults.
    config = load_run_config(write(tmp_path, "{}"))
    assert config == RunConfig()
    assert isinstance(config.data, HaystackDataConfig)


def test_sections_are_read(tmp_path):
    config = load_run_config(
        write(
            tmp_path,
            """
run_id: exp-1
model: {init_family: llama, dtype: bfloat16}
engine: {shard_tokens: 17, prompt_grad: detached}
grpo: {num_generations: 4, epsilon: 0.1, epsilon_high: 0.28, beta: 0.04, loss_type: dr_grpo}
train: {num_steps: 3, groups_per_step: 1}
data: {type: jsonl, path: prompts.jsonl, rewards: [haystack_exact]}
""",
        )
    )
    assert config.run_id == "exp-1"
    assert (config.model.init_family, config.model.dtype) == ("llama", "bfloat16")
    assert (config.engine.shard_tokens, config.engine.prompt_grad) == (17, "detached")
    assert (config.grpo.epsilon, config.grpo.effective_epsilon_high) == (0.1, 0.28)
    assert config.grpo.loss_type == "dr_grpo"
    assert isinstance(config.data, JsonlDataConfig)
    assert config.data.path == "prompts.jsonl"


def test_overrides_replace_top_level_keys(tmp_path):
    config = load_run_config(write(tmp_path, "run_id: a\n"), run_id="b")
    assert config.run_id == "b"


def test_bad_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "grpo: {num_generations: 8\n")
    with pytest.raises(ConfigError, match=r"run\.yaml is not valid YAML"):
        load_run_config(path)


def test_missing_file_says_so(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "nope.yaml")


def test_a_list_at_top_level_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"must hold a mapping of sections.*got list"):
        load_run_config(write(tmp_path, "- grpo\n- train\n"))


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("grpo: {epsilon_hi: 0.28}\n", "grpo.epsilon_hi"),
        ("trian: {num_steps: 3}\n", "trian"),
        ("engine: {shard_token: 3}\n", "engine.shard_token"),
        ("data: {type: haystack, num_prompt: 3}\n", "data.haystack.num_prompt"),
    ],
)
def test_unknown_keys_are_named(tmp_path, text, field):
    with pytest.raises(ConfigError) as error:
        load_run_config(write(tmp_path, text))
    message = str(error.value)
    assert f"  {field}: Extra inputs are not permitted" in message, message


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("grpo: {epsilon: 1.5}\n", "grpo.epsilon"),
        ("grpo: {num_generations: 1}\n", "grpo.num_generations"),
        ("grpo: {learning_rate: 0}\n", "grpo.learning_rate"),
        ("grpo: {top_p: 1.2}\n", "grpo.top_p"),
        ("engine: {shard_tokens: 0}\n", "engine.shard_tokens"),
        ("engine: {prompt_grad: approximate}\n", "engine.prompt_grad"),
        ("train: {num_steps: -1}\n", "train.num_steps"),
        ("model: {init_family: gpt2}\n", "model.init_family"),
        ("run_id: 'has space'\n", "run_id"),
        ("data: {type: haystack, task: {num_prompt_tokens: 8}}\n", "data.haystack.task"),
    ],
)
def test_out_of_range_values_are_named(tmp_path, text, field):
    with pytest.raises(ConfigError) as error:
        load_run_config(write(tmp_path, text))
    message = str(error.value)
    assert f"\n  {field}" in message, message
    assert message.startswith(f"{tmp_path / 'run.yaml'}: 1 invalid setting(s):"), message


def test_every_bad_field_is_listed(tmp_path):
    text = "grpo: {epsilon: 1.5, beta: -1}\nengine: {shard_tokens: 0}\n"
    with pytest.raises(ConfigError) as error:
        load_run_config(write(tmp_path, text))
    message = str(error.value)
    assert "3 invalid setting(s)" in message, message
    for field in ("grpo.epsilon", "grpo.beta", "engine.shard_tokens"):
        assert f"  {field}:" in message, message


def test_unknown_data_type_names_data_and_the_tags(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_run_config(write(tmp_path, "data: {type: csv, path: x.csv}\n"))
    message = str(error.value)
    assert "\n  data: " in message, message
    assert "'haystack'" in message and "'jsonl'" in message, message


def test_data_without_type_names_data(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_run_config(write(tmp_path, "data: {path: x.jsonl}\n"))
    assert "\n  data: " in str(error.value), str(error.value)
    assert "'type'" in str(error.value)


def test_jsonl_data_without_path_names_the_field(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_run_config(write(tmp_path, "data: {type: jsonl, rewards: [haystack_exact]}\n"))
    assert "\n  data.jsonl.path: Field required" in str(error.value), str(error.value)


def test_reference_checkpoint_without_beta_says_what_to_change(tmp_path):
    with pytest.raises(ConfigError, match=r"set grpo\.beta > 0 to use the reference model"):
        load_run_config(write(tmp_path, "model: {reference_checkpoint: /ckpt}\n"))


def test_sections_are_frozen_and_documented():
    config = RunConfig()
    with pytest.raises(ValidationError, match="frozen"):
        config.run_id = "other"
    # The sections this module defines (GRPOConfig has its own test; StorageConfig's docstrings
    # live in longstraw/schemas/storage.py).
    sections = (
        RunConfig,
        ModelConfig,
        EngineConfig,
        HaystackDataConfig,
        JsonlDataConfig,
        TrainConfig,
        ParallelConfig,
    )
    for section in sections:
        assert section.model_config["frozen"] and section.model_config["extra"] == "forbid"
        missing = [name for name, f in section.model_fields.items() if not f.description]
        assert not missing, (section.__name__, missing)
