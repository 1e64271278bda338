"""docs/config.md is generated from the run config's field docstrings and kept current."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticUndefined

from longstraw.schemas.config_docs import (
    REGENERATE_COMMAND,
    field_docs,
    render_config_markdown,
)
from longstraw.schemas.data import HaystackTaskConfig
from longstraw.schemas.run import HaystackDataConfig, JsonlDataConfig, RunConfig

CONFIG_MD = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _sections(markdown: str) -> dict[str, dict[str, list[str]]]:
    """'## heading' -> key -> the row's cells [key, type, default, meaning]."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in markdown.splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:], {})
        match = re.match(r"^\| `(\w+)` \| (.*) \|$", line)
        if match:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", match.group(2))]
            current[match.group(1)] = [match.group(1), *cells]
    return sections


def _documented_models() -> dict[str, type[BaseModel]]:
    """'## heading' -> the model whose fields that section lists."""
    models = {
        "Top level": RunConfig,
        "`data` (`type: haystack`)": HaystackDataConfig,
        "`data` (`type: jsonl`)": JsonlDataConfig,
        "`data.task`": HaystackTaskConfig,
    }
    for name in ("model", "engine", "grpo", "train", "storage", "parallel"):
        models[f"`{name}`"] = RunConfig.model_fields[name].annotation
    return models


def test_docs_config_md_is_the_generated_text():
    rendered = render_config_markdown()
    on_disk = CONFIG_MD.read_text() if CONFIG_MD.exists() else ""
    assert on_disk == rendered, (
        "docs/config.md is stale: a field of RunConfig (or a section it nests) changed. "
        f"Regenerate it from the repository root with:\n    {REGENERATE_COMMAND}"
    )
    assert REGENERATE_COMMAND in rendered


def test_every_field_of_every_section_has_a_row_with_its_docstring_and_default():
    sections = _sections(render_config_markdown())
    for heading, model in _documented_models().items():
        rows = sections[heading]
        docs = field_docs(model)
        # The top level lists its plain keys; each section has its own heading.
        expected = [
            name
            for name, field in model.model_fields.items()
            if model is not RunConfig
            or (
                not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel))
                and name not in ("data", "agent", "eval")  # a union and optional sections
            )
        ]
        assert sorted(rows) == sorted(expected), heading
        for name in expected:
            field = model.model_fields[name]
            _, _, default, meaning = rows[name]
            assert " ".join(docs[name].split()).replace("|", "\\|") in meaning, (heading, name)
            if field.default is not PydanticUndefined and field.default_factory is None:
                # The default cell is YAML that loads back to the field's default.
                loaded = yaml.safe_load(default.strip("`"))
                expected_default = (
                    list(field.default) if isinstance(field.default, tuple) else field.default
                )
                assert loaded == expected_default, (heading, name, default)
            elif field.default is PydanticUndefined and field.default_factory is None:
                assert default == "required", (heading, name)


def test_the_defaults_of_an_omitted_section_are_stated_under_its_heading():
    markdown = render_config_markdown()
    grpo = markdown.split("## `grpo`")[1].split("## ")[0]
    defaults = RunConfig().grpo
    # The run's grpo default differs from GRPOConfig's field defaults in these settings.
    for name in defaults.model_fields_set:
        value = yaml.safe_dump(getattr(defaults, name), default_flow_style=True)
        value = value.removesuffix("\n").removesuffix("\n...")
        assert f"`{name}: {value}`" in grpo, name
    assert "`learning_rate: 0.05`" in grpo


def test_a_field_without_a_docstring_is_an_error_that_names_it():
    class Section(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)

        documented: int = 1
        """Has a meaning."""
        bare: int = 2

    with pytest.raises(ValueError, match=r"field\(s\) bare have no docstring"):
        field_docs(Section)
