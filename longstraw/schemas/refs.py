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
    """Digest of the content (sha256 over names, shapes and per-tensor fp64 sum, magnitude and
    norm): identical contributions compare equal, a doubled or partial one does not."""
    policy_version: int = Field(ge=0)
    """Version of the weights the gradient was taken at; reduction refuses to mix versions."""
    specs: tuple[TensorSpec, ...] = ()
    num_tokens: int = Field(default=0, ge=0)
    """Completion tokens the contribution covers."""


class PromptRef(_Ref):
    """One prompt of a step, at the policy version its state is computed for."""

    index: int = Field(ge=0)
    """Position in the run's prompt stream (the data source recreates the prompt from it)."""
    prompt_id: str
    prompt_digest: str
    num_tokens: int = Field(ge=1)
    num_shards: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    weights_digest: str


class ShardRef(_Ref):
    """A prefill shard that is in storage (and in this process's session when it ran here)."""

    prompt_digest: str
    shard: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    weights_digest: str
    computed: bool
    """False when the shard was read back from storage instead of computed."""


class RolloutRef(_Ref):
    """A group's sampled responses and rewards (the state stays in the process's session)."""

    handle: str
    """Name of the rollout in the process-local registry."""
    prompt: PromptRef
    response_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    texts: list[str]
    truncated: list[bool]
    rewards: list[float]


class UpdateResult(_Ref):
    """What an optimizer step produced."""

    policy_version: int
    """Version after the update."""
    grad_norm: float
    learning_rate: float
    clipped: bool
    checkpoint: CheckpointRef | None = None
    """Set when this update's version was checkpointed."""


__all__ = [
    "CheckpointRef",
    "GradRef",
    "PrefixStateRef",
    "PromptRef",
    "RolloutRef",
    "ShardRef",
    "TensorSpec",
    "UpdateResult",
]
