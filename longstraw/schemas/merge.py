"""Overrides merged field by field onto a config, the way its schema reads it.

A run's configuration comes in layers: a YAML file (or nothing: the defaults), a deployment's
`config`, a run's `config`, the command line's flags. Each layer changes only the fields it
names, merged onto what the layers under it give — their *effective* values, defaults included:

- a section the base leaves out starts from the default it would take there, which is not always
  its class's defaults (RunConfig's `grpo` default is the demo's settings, not `GRPOConfig()`):
  naming one of its fields does not switch the others to another set of defaults;
- a tagged section (a union keyed on a discriminator, `data: {type: haystack | jsonl}`) keeps
  the base's tag when the override gives none, and is replaced whole when the override names
  another tag (the other kind's fields would not fit it);
- a section whose base is null (`eval`, `agent` left out) is built from the override alone;
- a plain mapping field (`agent.environment_args`) merges key by key; anything else (a number,
  a string, a list, an explicit null) replaces the base's value.

Mappings in, a mapping out (JSON values): nothing is validated here, so a layer may be invalid on
its own (a deployment that leaves a required field to its runs); the caller validates the result
once. No torch, no Prefect: the CLI merges its flags with this before importing either.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

Sections = dict[str | None, type[BaseModel]]
"""The model classes a field may hold: {None: cls} for a plain (or optional) section, {tag: cls}
for a tagged union."""


def merge_fields(
    model: type[BaseModel], base: Mapping[str, Any], *layers: Mapping[str, Any]
) -> dict[str, Any]:
    """`base` (a mapping for `model`, whole or partial) with each of `layers` merged onto it in
    order, field by field as the module docstring says."""
    out = dict(base)
    for layer in layers:
        for key, value in layer.items():
            info = model.model_fields.get(key)
            if key not in out and isinstance(value, Mapping) and info is not None:
                out[key] = _default_json(info)
            out[key] = _merge_field(info, out.get(key), value)
    return out


def nested(values: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted paths to values as a nested mapping: {"parallel.world_size": 2,
    "parallel.data_parallel": 2} → {"parallel": {"world_size": 2, "data_parallel": 2}}. Only the
    named fields: nothing is filled in (a layer for `merge_fields`)."""
    out: dict[str, Any] = {}
    for path, value in values.items():
        *sections, name = path.split(".")
        node = out
        for section in sections:
            node = node.setdefault(section, {})
            assert isinstance(node, dict), f"{path} is inside a field given a value"
        assert name not in node, f"{path} is given twice (or is a section with fields given)"
        node[name] = value
    return out


def tags_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> tuple[str, ...]:
    """The tags the tagged union at `loc` (a validation error's location) takes; () where `loc`
    is not a tagged union."""
    sections: Sections = {None: model}
    for part in loc:
        if len(sections) > 1:
            if part not in sections:
                return ()
            sections = {None: sections[part]}
            continue
        info = sections[None].model_fields.get(str(part))
        sections = field_sections(info) if info is not None else {}
        if not sections:
            return ()
    return tuple(str(tag) for tag in sections) if len(sections) > 1 else ()


def _merge_field(info: FieldInfo | None, current: Any, value: Any) -> Any:
    if not isinstance(value, Mapping):
        return value
    sections = field_sections(info) if info is not None else {}
    if not sections:  # a plain mapping (or a key the schema does not know: validation names it)
        return _merge_mappings(current, value) if isinstance(current, Mapping) else dict(value)
    if len(sections) == 1:
        base = current if isinstance(current, Mapping) else {}
        return merge_fields(sections[None], base, value)
    key = info.discriminator
    current_tag = current.get(key) if isinstance(current, Mapping) else None
    tag = value.get(key, current_tag)
    if tag not in sections:
        return dict(value)  # no tag to keep, or an unknown one: validation says which to give
    return merge_fields(sections[tag], current if tag == current_tag else {}, value)


def _merge_mappings(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        current = out.get(key)
        both = isinstance(value, Mapping) and isinstance(current, Mapping)
        out[key] = _merge_mappings(current, value) if both else value
    return out


def field_sections(info: FieldInfo) -> Sections:
    """The model classes `info`'s field holds, by tag; {} for a field that holds no model (or a
    union of models with no discriminator to tell them apart)."""
    annotation = info.annotation
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
    else:
        members = [annotation]
    if not all(isinstance(m, type) and issubclass(m, BaseModel) for m in members):
        return {}
    if len(members) == 1:
        return {None: members[0]}
    if not isinstance(info.discriminator, str):
        return {}
    return {_tag(m, info.discriminator): m for m in members}


def _tag(model: type[BaseModel], discriminator: str) -> str:
    annotation = model.model_fields[discriminator].annotation
    assert get_origin(annotation) is Literal, f"{model.__name__}.{discriminator} is not a Literal"
    (tag,) = get_args(annotation)
    return tag


def _default_json(info: FieldInfo) -> Any:
    """The field's default as JSON values (a model's default as its mapping); None when the field
    is required (the override then builds it alone)."""
    if info.is_required():
        return None
    default = info.get_default(call_default_factory=True)
    return default.model_dump(mode="json") if isinstance(default, BaseModel) else default
