"""Refs: small pointers to stored bytes that tasks pass each other instead of tensors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from longstraw.schemas.storage import PrefixStateRef


class _Ref(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class CheckpointRef(_Ref):
    """A committed training checkpoint: a Hugging Face directory plus optimizer/RNG state."""

    uri: str
    """Directory of the checkpoint (file:// URI)."""
    weights_digest: str
    """sha256 of its safetensors weights, computed once when it was written."""
    policy_version: int = Field(ge=0)
    """Optimizer steps taken to reach these weights."""


class TensorSpec(_Ref):
    """Name, shape and dtype of one tensor behind a ref."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class GradRef(_Ref):
    """One task's gradient contribution: fp32 tensors by parameter name, held in-process or stored.

    `uri` is `memory://grads/<id>` for a contribution kept in the process-local registry (the
    single-machine path pays no I/O) or a file:// / s3:// safetensors file.
    """

    uri: str
    digest: str
    """Content digest (sha256 over names, shapes and bytes): identical contributions compare equal."""
    policy_version: int = Field(ge=0)
    """Version of the weights the gradient was taken at; reduction refuses to mix versions."""
    specs: tuple[TensorSpec, ...] = ()
    num_tokens: int = Field(default=0, ge=0)
    """Completion tokens the contribution covers."""


__all__ = ["CheckpointRef", "GradRef", "PrefixStateRef", "TensorSpec"]
