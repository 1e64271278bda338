"""Overrides merge field by field onto the effective config (`longstraw.schemas.merge`): the one
merge of config files, deployments, runs and command-line flags."""

from __future__ import annotations

import pytest

from longstraw.schemas.merge import nested, tags_at
from longstraw.schemas.run import ConfigError, RunConfig, merged, parse_run_config

FILE = """
run_id: layered
grpo: {learning_rate: 1.0e-5, loss_type: dapo, max_completion_length: 64}
data: {type: jsonl, path: prompts.jsonl, rewards: [haystack_exact]}
"""


def test_layers_apply_in_order_each_onto_what_the_ones_before_give():
    deployment = {"grpo": {"beta": 0.1, "learning_rate": 3e-5}, "train": {"num_steps": 2}}
    run = {"grpo": {"learning_rate": 2e-5}, "data": {"responses_path": "r.jsonl"}}
    config = parse_run_config(FILE, "run.yaml", deployment, run)
    assert config.grpo.learning_rate == 2e-5  # the run's, over the deployment's, over the file's
    assert config.grpo.beta == 0.1  # the deployment's
    assert (config.grpo.loss_type, config.grpo.max_completion_length) == ("dapo", 64)  # the file's
    assert config.data.type == "jsonl" and config.data.path == "prompts.jsonl"
    assert config.data.responses_path == "r.jsonl"
    assert config.train.num_steps == 2 and config.train.groups_per_step == 2


def test_a_section_left_out_starts_from_its_default_in_the_run_config():
    # RunConfig's `grpo` default is the demo's settings (learning rate 0.05), not GRPOConfig()'s.
    raw = merged({"run_id": "r"}, {"grpo": {"beta": 0.1}})
    config = RunConfig.model_validate(raw)
    assert config.grpo == RunConfig().grpo.model_copy(update={"beta": 0.1})


def test_another_tag_replaces_a_tagged_section_and_the_same_tag_merges():
    haystack = {"data": {"type": "haystack", "num_prompts": 3}}
    switched = merged(haystack, {"data": {"type": "jsonl", "path": "p", "rewards": ["r"]}})
    assert switched["data"] == {"type": "jsonl", "path": "p", "rewards": ["r"]}
    same = merged(haystack, {"data": {"type": "haystack", "rewards": ["r"]}})
    assert same["data"] == {"type": "haystack", "num_prompts": 3, "rewards": ["r"]}


def test_an_optional_section_left_out_is_built_from_the_override_alone():
    raw = merged({}, {"agent": {"environment": "key_lookup"}})
    assert raw["agent"] == {"environment": "key_lookup"}
    assert RunConfig.model_validate(raw).agent.max_turns == 4


def test_plain_mappings_merge_key_by_key_and_values_replace():
    base = {"agent": {"environment": "e", "environment_args": {"a": 1, "b": {"c": 2}}}}
    raw = merged(base, {"agent": {"environment_args": {"b": {"d": 3}}}})
    assert raw["agent"]["environment_args"] == {"a": 1, "b": {"c": 2, "d": 3}}
    replaced = merged(
        {"data": {"type": "haystack", "rewards": ["a", "b"]}}, {"data": {"rewards": ["c"]}}
    )
    assert replaced["data"]["rewards"] == ["c"]
    assert merged({"eval": {"data": {}}}, {"eval": None}) == {"eval": None}


def test_a_tagged_section_without_a_type_names_the_types_to_give():
    with pytest.raises(ConfigError) as refused:
        parse_run_config("data: {num_prompts: 5}\n", "run.yaml")
    assert "  data: no 'type' given — add type: 'haystack' or 'jsonl'" in str(refused.value)


def test_tags_at_a_location():
    assert tags_at(RunConfig, ("data",)) == ("haystack", "jsonl")
    assert tags_at(RunConfig, ("eval", "data")) == ("haystack", "jsonl")
    assert tags_at(RunConfig, ("grpo",)) == ()
    assert tags_at(RunConfig, ("data", "haystack", "task")) == ()


def test_nested_builds_the_named_fields_only():
    flags = {"parallel.world_size": 2, "parallel.data_parallel": 2, "run_id": "r"}
    assert nested(flags) == {"parallel": {"world_size": 2, "data_parallel": 2}, "run_id": "r"}
    with pytest.raises(AssertionError, match="inside a field given a value"):
        nested({"parallel": 1, "parallel.world_size": 2})
    with pytest.raises(AssertionError, match="given twice"):
        nested({"parallel.world_size": 2, "parallel": 1})
