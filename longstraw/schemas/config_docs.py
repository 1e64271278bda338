"""docs/config.md, rendered from the run config's field docstrings.

Regenerate after changing any field of `RunConfig` or of a section it nests:

    python -m longstraw.schemas.config_docs > docs/config.md

tests/schemas/test_config_docs.py fails while docs/config.md differs from this output.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from longstraw.schemas.run import RunConfig

REGENERATE_COMMAND = "python -m longstraw.schemas.config_docs > docs/config.md"

_INTRO = """\
# Run configuration

<!-- Generated from the field docstrings of longstraw/schemas/run.py and the sections it nests.
     Do not edit by hand; regenerate with:
         {command}
-->

`longstraw train --config run.yaml` reads one YAML file into `RunConfig`. A key left out takes
the default in its section's table (keys marked "required" must be given when their section is);
a section left out entirely takes those defaults too, except for the settings noted under its
heading. Unknown keys and out-of-range values are errors that name the field by its dotted path
(`grpo.epsilon_high`). `examples/run.yaml` is a complete example.

Overrides laid over a config — `longstraw train`'s flags (`--steps`, `--world-size`, ...), a
Prefect deployment's `config` and a run's `config` (docs/orchestration.md) — change only the
fields they name, merged one by one onto the config they override as it would run: a section the
file leaves out starts from its default here (`{{"grpo": {{"beta": 0.1}}}}` keeps the demo's
learning rate), a `type`-tagged section (`data`, `eval.data`) keeps its `type` unless the
override names another (then it replaces the section whole), and a mapping such as
`agent.environment_args` merges key by key. Within the file itself a section that is given is
read as written: its keys left out take the defaults in its table.

GRPO settings keep the names and defaults of TRL's `GRPOConfig`; optimiser settings keep the
names of transformers' `TrainingArguments`.
"""


def render_config_markdown() -> str:
    """docs/config.md: every section of `RunConfig` and every field's type, default, constraints
    and docstring, in declaration order. Deterministic: defaults that read the environment are
    described, not evaluated."""
    out = [_INTRO.format(command=REGENERATE_COMMAND)]
    out += _section("Top level", RunConfig, prefix="", top_level=True)
    for name, field in RunConfig.model_fields.items():
        models = _models_in(field.annotation)
        if not models:
            continue
        for model in models:
            out += _model_sections(f"{name}", model, field, len(models) > 1)
    return "\n".join(out).rstrip() + "\n"


def _model_sections(
    path: str, model: type[BaseModel], field: FieldInfo | None, is_variant: bool
) -> list[str]:
    """The section of `model` at dotted `path`, then the sections of the models it nests."""
    title = f"`{path}`"
    if is_variant:
        title += f" (`type: {model.model_fields['type'].default}`)"
    out = [f"## {title}", "", _docstring(model.__doc__), ""]
    if is_variant and field is not None and field.default_factory is model:
        out += [f"The variant used when `{path}` is left out.", ""]
    elif field is not None and not is_variant:
        out += _section_default(field, model)
    out += _section(None, model, prefix=f"{path}.", top_level=False)
    for name, sub in model.model_fields.items():
        nested = _models_in(sub.annotation)
        for inner in nested:
            # A union (`eval.data`) gets one section per variant, as the top level's `data`.
            out += _model_sections(f"{path}.{name}", inner, sub, len(nested) > 1)
    return out


def _section(title: str | None, model: type[BaseModel], prefix: str, top_level: bool) -> list[str]:
    """A table of `model`'s fields that are plain values (sections get their own heading)."""
    docs = field_docs(model)
    rows = []
    for name, field in model.model_fields.items():
        if top_level and _models_in(field.annotation):
            continue
        description = docs[name]
        if top_level is False and _models_in(field.annotation):
            description += f" See `{prefix}{name}` below."
        constraints = _constraints(field)
        if constraints:
            description += f" Allowed: {constraints}."
        rows.append(
            f"| `{name}` | {_cell(_type_name(field.annotation))} | {_cell(_default(field))} "
            f"| {_cell(description.strip())} |"
        )
    out = []
    if title is not None:
        out += [f"## {title}", "", _docstring(model.__doc__), ""]
    if rows:
        out += ["| Key | Type | Default | Meaning |", "|---|---|---|---|", *rows, ""]
    return out


def _section_default(field: FieldInfo, model: type[BaseModel]) -> list[str]:
    """When the whole section is left out, the fields its default sets away from the table's."""
    if field.default_factory is None or isinstance(field.default_factory, type):
        return []
    value = field.default_factory()
    if not isinstance(value, model):
        return []
    explicit = {
        name: getattr(value, name)
        for name in model.model_fields
        if name in value.model_fields_set and name != "type"
    }
    if not explicit:
        return []
    settings = ", ".join(f"`{name}: {_plain(v)}`" for name, v in explicit.items())
    return [
        f"Left out entirely, this section is {settings} with every other key at its default "
        "below; a section given in the YAML starts from the defaults below.",
        "",
    ]


def field_docs(model: type[BaseModel]) -> dict[str, str]:
    """name -> docstring of every field of `model`, in declaration order.

    Raises ValueError naming each field that has none: the docs page would have an empty row."""
    found = _attribute_docstrings(model)
    docs = {
        name: field.description or found.get(name, "") for name, field in model.model_fields.items()
    }
    missing = [name for name, text in docs.items() if not text.strip()]
    if missing:
        raise ValueError(
            f"{model.__qualname__} field(s) {', '.join(missing)} have no docstring: write a string "
            'literal on the line after each field (`name: int = 1` then `"""What it means."""`)'
        )
    return docs


def _attribute_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """name -> the string literal right after `name: type = ...` in the class body (base classes
    first, so a subclass's docstring wins)."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if cls is BaseModel or not issubclass(cls, BaseModel):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(cls))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, following in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field holds: itself, or each member of a (discriminated) union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) is typing.Annotated:
        return _models_in(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        # An optional section (`Section | None`) is documented as its section.
        members = [m for m in get_args(annotation) if m is not type(None)]
        if all(isinstance(m, type) and issubclass(m, BaseModel) for m in members):
            return list(members)
    return []


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(get_args(annotation)[0])
    if origin is Literal:
        return " | ".join(_value(v) for v in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(annotation))
    if origin is not None:
        args = get_args(annotation)
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return "section" if issubclass(annotation, BaseModel) else annotation.__name__
    return str(annotation)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        if isinstance(field.default_factory, type):
            return "section defaults"
        if getattr(field.default_factory, "__name__", "") != "<lambda>":
            # A named factory may read the environment (the S3 endpoint): describe, not evaluate.
            return "from the environment (see meaning)"
        value = field.default_factory()
        return "section defaults" if isinstance(value, BaseModel) else _value(value)
    if field.default is PydanticUndefined:
        return "required"
    return _value(field.default)


def _value(value: Any) -> str:
    """A value as YAML spells it, in a code span."""
    return f"`{_plain(value)}`"


def _plain(value: Any) -> str:
    """YAML flow style, so that `yaml.safe_load` of the text gives the value back."""
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _constraints(field: FieldInfo) -> str:
    words = []
    for item in field.metadata:
        for attribute, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if isinstance(item, getattr(annotated_types, attribute.capitalize())):
                words.append(f"{symbol} {getattr(item, attribute)}")
        if isinstance(item, annotated_types.MinLen):
            words.append(f"at least {item.min_length} item(s)")
        if isinstance(item, annotated_types.MaxLen):
            words.append(f"at most {item.max_length} item(s)")
        pattern = getattr(item, "pattern", None)
        if isinstance(pattern, str):
            words.append(f"matches `{pattern}`")
    return ", ".join(words)


def _docstring(text: str | None) -> str:
    return " ".join(inspect.cleandoc(text or "").split())


def _cell(text: str) -> str:
    """One table cell: a single line with `|` escaped."""
    return " ".join(text.split()).replace("|", "\\|")


if __name__ == "__main__":
    print(render_config_markdown(), end="")
