"""A deployment run's `config` changes exactly the fields it names: every field of every section,
overridden alone, against the configuration the deployment would run without it.

The deployments are the shipped ones (prefect.yaml: `local` without a config file, `gpu` with
the example file it ships) and two built on `local` that set the optional sections (`eval`,
`agent`), so that each of those has a base to merge onto. Each override goes through the flow's
parameter type (`RunConfigOverrides`, as Prefect validates it) and the flow's own
`run_config`; the expected config is the effective one with that one field replaced, validated
as a whole. Where that expectation is invalid (a value another field's constraint refuses), the
override must be refused too.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from longstraw.flows.train import run_config
from longstraw.schemas.merge import field_sections, nested
from longstraw.schemas.overrides import RunConfigOverrides
from longstraw.schemas.run import ConfigError, RunConfig

ROOT = Path(__file__).resolve().parents[2]


def _shipped() -> dict[str, dict]:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return {d["name"]: d["parameters"] for d in spec["deployments"]}


def _deployments() -> dict[str, tuple[dict, str | None]]:
    """name → (the deployment's `config`, its `config_file` as a path in this checkout)."""
    shipped = _shipped()
    local = shipped["local"]["config"]
    gpu_file = shipped["gpu"]["config_file"].replace("/opt/longstraw", str(ROOT))
    with_eval = local | {
        "train": local["train"] | {"eval_steps": 1},
        "eval": {"data": {"type": "haystack", "num_prompts": 2, "task": {"seed": 7}}},
    }
    with_agent = local | {"agent": {"environment": "key_lookup", "max_turns": 2}}
    return {
        "local": (local, None),
        "gpu": (shipped["gpu"]["config"], gpu_file),
        "local+eval": (with_eval, None),
        "local+agent": (with_agent, None),
    }


def _run(deployment: str, overrides: dict) -> RunConfig:
    config, config_file = _deployments()[deployment]
    parameter = RunConfigOverrides.model_validate(overrides)  # what Prefect hands the flow
    return run_config(parameter, config_file, config)


def _effective(deployment: str) -> RunConfig:
    return _run(deployment, {})


def test_the_issue_case_one_grpo_field_keeps_the_deployments_other_grpo_settings():
    base = _effective("local")
    run = _run("local", {"grpo": {"beta": 0.1}})
    assert run.grpo.beta == 0.1
    # The local deployment leaves `grpo` out: the demo's settings, not GRPOConfig()'s defaults.
    assert (run.grpo.learning_rate, run.grpo.max_completion_length) == (0.05, 2)
    assert run.grpo.loss_type == "grpo"
    assert run.model_copy(update={"grpo": base.grpo}) == base


def test_a_partial_data_override_keeps_the_deployments_type():
    base = _effective("local")
    run = _run("local", {"data": {"num_prompts": 5}})
    assert run.data.type == "haystack" and run.data.num_prompts == 5
    assert run.data.task == base.data.task and run.data.rewards == base.data.rewards


def test_another_data_type_replaces_the_section_whole():
    data = {"type": "jsonl", "path": "prompts.jsonl", "rewards": ["haystack_exact"]}
    run = _run("local", {"data": data})
    assert run.data.model_dump() == data | {"responses_path": None}


def test_a_tagged_section_with_no_type_to_keep_is_refused_asking_for_type():
    overrides = {"train": {"eval_steps": 1}, "eval": {"data": {"num_prompts": 5}}}
    with pytest.raises(ConfigError) as refused:
        _run("local", overrides)
    assert "eval.data: no 'type' given — add type: 'haystack' or 'jsonl'" in str(refused.value)
    assert "Unable to extract tag" not in str(refused.value)


def _leaves(value: Any, annotation: Any, info, path: str):
    """(dotted path, annotation, current value) of every non-section field under `path`."""
    sections = field_sections(info) if info is not None else {}
    if isinstance(value, BaseModel) and sections:
        for name, field in type(value).model_fields.items():
            yield from _leaves(getattr(value, name), field.annotation, field, f"{path}.{name}")
        return
    if not sections:
        yield path, annotation, value


TAG = object()
"""What `_other_value` gives for a single-choice Literal: a tagged section's kind, not a value."""


def _other_value(annotation: Any, current: Any) -> tuple[bool, Any]:
    """A JSON value of `annotation` that differs from `current` (False: none this test makes)."""
    members = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else ()
    if members and type(None) in members:
        (inner, *more) = [m for m in members if m is not type(None)]
        return (False, None) if more else _other_value(inner, current)
    if get_origin(annotation) is Literal:
        if len(get_args(annotation)) == 1:
            return True, TAG  # a section's kind: test_another_data_type_replaces_the_section_whole
        others = [choice for choice in get_args(annotation) if choice != current]
        return (True, others[0]) if others else (False, None)
    if annotation is bool:
        return True, not current
    if annotation is int:
        return True, 3 if current is None else current + 1
    if annotation is float:
        return True, 0.5 if not current else current / 2
    if annotation is str:
        return True, "override" if current is None else f"{current}x"
    if get_origin(annotation) in (list, tuple):
        item = get_args(annotation)[0]
        if get_origin(item) is Literal:
            first = [get_args(item)[0]]
            return True, [] if current == first else first
        if item is float:
            return True, [0.5] if current is None else [*current, 0.5]
        return (True, [*current, *current]) if current else (False, None)
    if get_origin(annotation) is dict:
        return True, {"added": 1}
    return False, None


def _set(mapping: dict, path: str, value: Any) -> dict:
    head, _, rest = path.partition(".")
    out = dict(mapping)
    out[head] = _set(out[head], rest, value) if rest else value
    return out


def _with_added(mapping: dict, path: str, value: dict) -> dict:
    """`mapping` with the keys of `value` added to the mapping field at `path`."""
    head, _, rest = path.partition(".")
    out = dict(mapping)
    out[head] = _with_added(out[head], rest, value) if rest else out[head] | value
    return out


@pytest.mark.parametrize("deployment", list(_deployments()))
def test_every_one_field_override_changes_that_field_and_nothing_else(deployment):
    base = _effective(deployment)
    base_json = base.model_dump(mode="json")
    accepted: dict[str, int] = {}
    untested = []
    for section, info in RunConfig.model_fields.items():
        value = getattr(base, section)
        if not field_sections(info) or value is None:
            continue
        for path, annotation, current in _leaves(value, info.annotation, info, section):
            makes, new = _other_value(annotation, current)
            if new is TAG:
                continue
            if not makes:
                untested.append(path)
                continue
            if isinstance(new, dict):
                expected_json = _with_added(base_json, path, new)
            else:
                expected_json = _set(base_json, path, new)
            try:
                expected = RunConfig.model_validate(expected_json)
            except ValidationError:
                expected = None
            override = nested({path: new})
            if expected is None:
                with pytest.raises((ConfigError, ValidationError)):
                    _run(deployment, override)
                continue
            got = _run(deployment, override)
            assert got.model_dump(mode="json") == expected.model_dump(mode="json"), path
            accepted[section] = accepted.get(section, 0) + 1
    present = {s for s in RunConfig.model_fields if field_sections(RunConfig.model_fields[s])}
    present = {s for s in present if getattr(base, s) is not None}
    assert set(accepted) == present, (
        f"sections with no accepted override: {present - set(accepted)}"
    )
    # Fields whose type this test cannot make a second value of: say which, so a new one is seen.
    assert not untested, f"no second value made for {untested}"
