"""Partial run configs: the `config` parameter of the `train` flow, typed field by field.

`RunConfigOverrides` has the fields of `RunConfig`, each section a partial of its own, every
field optional: a deployment run that names `{"train": {"num_steps": 1}}` sets that one field
and nothing else. As the flow's type hint it gives Prefect a parameter schema that lists the
config's sections and fields (the UI's Custom-run form shows them, with their docstrings), and an
unknown or misspelt key is refused when the run is created. `data` and `agent` stay mappings:
which fields they take depends on their `type` or environment, so a partial of them is merged
as it is.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from longstraw.schemas.run import RunConfig

_AS_MAPPINGS = frozenset({"data", "agent"})
"""RunConfig fields whose overrides are plain mappings (unions: no single partial shape)."""


class _Partial(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def overrides(self) -> dict[str, Any]:
        """Only the fields that were given (an explicit null included), as JSON values."""
        return self.model_dump(mode="json", exclude_unset=True)


def _section_type(annotation: Any) -> type[BaseModel] | None:
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def partial_model(model: type[BaseModel], name: str) -> type[_Partial]:
    """`model` with every field optional (default None) and every section field a partial."""
    fields: dict[str, Any] = {}
    for field_name, info in model.model_fields.items():
        section = _section_type(info.annotation)
        if field_name in _AS_MAPPINGS and model is RunConfig:
            annotation: Any = dict[str, Any] | None
        elif section is not None:
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
