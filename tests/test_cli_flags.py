"""`longstraw train`'s config flags merge field by field: any two of them, two of one section
included (`--world-size 2 --data-parallel 2`), each set what it names.

The flags come from the command itself (its click parameters), so a new one is covered: it must
be listed in `CONFIG_OPTIONS` (a config field) or in `OTHER_OPTIONS` below, and its test value is
made from the type of the field it sets. The command runs through typer with `run_training`
replaced by a recorder: what is checked is the config the command would train.
"""

from __future__ import annotations

import itertools
from typing import Any, Literal, get_args, get_origin

import pytest
import typer
from typer.testing import CliRunner

from longstraw import train_entry
from longstraw.cli import CONFIG_OPTIONS, app
from longstraw.schemas.run import RunConfig

OTHER_OPTIONS = {"config", "resume", "no_prefect", "debug"}
"""`longstraw train` options that set no config field."""


def _train_options() -> dict[str, str]:
    """Parameter name → its command-line flag, for every option of `longstraw train`."""
    train = typer.main.get_command(app).commands["train"]
    return {p.name: p.opts[0] for p in train.params if p.opts}


def _field(path: str):
    model, *names, name = [RunConfig, *path.split(".")]
    for section in names:
        model = model.model_fields[section].annotation
    return model.model_fields[name]


def _value(path: str, tmp_path) -> Any:
    """A value for the field at `path` other than its default, as the command line spells it."""
    info = _field(path)
    annotation = info.annotation
    members = [m for m in get_args(annotation) if m is not type(None)] or [annotation]
    (kind,) = members
    if path == "storage.root_uri":
        return str(tmp_path / "flag-root")
    if kind is int:
        return 2  # ≥ 1 everywhere, and 2 ranks × 2 replicas is a valid pair
    if kind is str:
        return f"flag-{path.replace('.', '-')}"
    if get_origin(kind) is Literal:
        return next(choice for choice in get_args(kind) if choice != info.default)
    raise AssertionError(f"add a test value for a flag of type {annotation} ({path})")


def _get(config: RunConfig, path: str) -> Any:
    value: Any = config
    for name in path.split("."):
        value = getattr(value, name)
    return value


@pytest.fixture
def trained(monkeypatch, tmp_path) -> list[RunConfig]:
    """The configs `longstraw train` hands to `run_training` (which runs nothing here)."""
    monkeypatch.chdir(tmp_path)
    seen: list[RunConfig] = []
    monkeypatch.setattr(train_entry, "run_training", lambda config, **_: seen.append(config))
    return seen


def test_every_train_option_is_a_config_field_or_named_as_not_one():
    options = set(_train_options())
    assert set(CONFIG_OPTIONS) <= options, set(CONFIG_OPTIONS) - options
    unclassified = options - set(CONFIG_OPTIONS) - OTHER_OPTIONS
    assert not unclassified, f"add {unclassified} to CONFIG_OPTIONS or to OTHER_OPTIONS"
    for path in CONFIG_OPTIONS.values():
        _field(path)  # names a field of RunConfig


def _section(path: str) -> str:
    return path.split(".")[0] if "." in path else ""


PAIRS = [
    (a, b)
    for a, b in itertools.combinations(sorted(CONFIG_OPTIONS), 2)
    if _section(CONFIG_OPTIONS[a]) == _section(CONFIG_OPTIONS[b])
]
"""Flags that set two fields of one section: the case where the second dropped the first."""


def test_the_pairs_include_the_flags_that_dropped_each_other():
    assert ("data_parallel", "world_size") in PAIRS, PAIRS


def _invoke_and_check(trained, values: dict[str, Any]) -> None:
    """`longstraw train` with the flags `values` (parameter name → value): each sets its field as
    it would alone, and nothing else moves."""
    flags = _train_options()
    args = ["train", *itertools.chain.from_iterable((flags[n], str(v)) for n, v in values.items())]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (config,) = trained
    # The defaults with those fields set, validated whole (validators normalise: a root path
    # becomes a file:// URI).
    raw = RunConfig().model_dump(mode="json")
    for name, value in values.items():
        *sections, field = CONFIG_OPTIONS[name].split(".")
        node = raw
        for section in sections:
            node = node[section]
        node[field] = value
    expected = RunConfig.model_validate(raw)
    for name in values:
        path = CONFIG_OPTIONS[name]
        assert _get(config, path) == _get(expected, path) != _get(RunConfig(), path), path
    assert config == expected


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=["+".join(p) for p in PAIRS])
def test_two_flags_of_one_section_each_set_their_field(trained, tmp_path, first, second):
    _invoke_and_check(trained, {n: _value(CONFIG_OPTIONS[n], tmp_path) for n in (first, second)})


def test_every_config_flag_at_once(trained, tmp_path):
    _invoke_and_check(trained, {n: _value(path, tmp_path) for n, path in CONFIG_OPTIONS.items()})


def test_world_size_and_data_parallel_on_top_of_a_config_file(trained, tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("run_id: file\nparallel: {backend: gloo, timeout_s: 60}\n")
    args = ["train", "--config", str(config_file), "--world-size", "4", "--data-parallel", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (config,) = trained
    assert (config.parallel.world_size, config.parallel.data_parallel) == (4, 2)
    assert config.parallel.timeout_s == 60 and config.run_id == "file"
