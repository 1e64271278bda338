"""Partial run configs: the `config` parameter of the `train` flow, typed field by field.

`RunConfigOverrides` has the fields of `RunConfig`, each section (optional ones too: `eval`,
`agent`) a partial of its own, every field optional: a deployment run that names
`{"train": {"num_steps": 1}}` sets that one field and nothing else — merged onto the effective
config by `longstraw.schemas.merge` (a section the deployment leaves out starts from its default,
a tagged section keeps its `type`). As the flow's type hint it gives Prefect a parameter schema
that lists the config's sections and fields (the UI's Custom-run form shows them, with their
docstrings), and an unknown or misspelt key is refused when the run is created. Tagged sections
(`data`, `eval.data`) stay mappings: which fields they take depends on their `type`, which a
partial may leave to the base.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from longstraw.schemas.merge import field_sections
from longstraw.schemas.run import RunConfig


class _Partial(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def overrides(self) -> dict[str, Any]:
        """Only the fields that were given (an explicit null included), as JSON values."""
        return self.model_dump(mode="json", exclude_unset=True)


def partial_model(model: type[BaseModel], name: str) -> type[_Partial]:
    """`model` with every field optional (default None), every section field (optional or not) a
    partial, and every tagged section a mapping."""
    fields: dict[str, Any] = {}
    for field_name, info in model.model_fields.items():
        sections = field_sections(info)
        if len(sections) > 1:
            annotation: Any = dict[str, Any] | None
        elif sections:
            section = sections[None]
            annotation = partial_model(section, f"{section.__name__}Overrides") | None
        else:
            annotation = info.annotation | None
        fields[field_name] = (annotation, Field(default=None, description=info.description))
    return create_model(name, __base__=_Partial, __doc__=model.__doc__, **fields)


RunConfigOverrides = partial_model(RunConfig, "RunConfigOverrides")
"""A partial `RunConfig`: the sections and fields to set, the rest left to the base config."""


def as_overrides(value: BaseModel | dict | None) -> dict[str, Any]:
    """The overrides a `config` parameter holds (a `RunConfigOverrides`, or a mapping as the
    Prefect API stores it), as a mapping of the fields given."""
    if value is None:
        return {}
    if isinstance(value, _Partial):
        return value.overrides()
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return dict(value)
