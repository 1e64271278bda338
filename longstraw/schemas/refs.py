"""Refs: small pointers to stored bytes that tasks pass each other instead of tensors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from longstraw.schemas.results import GroupStats, StateTraffic
from longstraw.schemas.storage import PrefixStateRef


class _Ref(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class CheckpointRef(_Ref):
    """A committed training checkpoint: a Hugging Face directory plus optimizer state."""

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


class GradPart(_Ref):
    """One rank's rows of a gradient whose weights are sharded over ranks."""

    uri: str
    digest: str


class GradRef(_Ref):
    """A gradient contribution: fp32 tensors by parameter name in a safetensors file (`uri`,
    file://); the process that wrote it also holds the tensors, so it reads nothing back.

    With the policy sharded over N ranks (`parts` non-empty) each rank stores only its dim-0
    rows of every tensor: `parts[r]` is rank r's file, and `uri`/`digest` are rank 0's."""

    uri: str
    digest: str
    """Digest of the content (sha256 over names, shapes and per-tensor fp64 sum, magnitude and
    norm): identical contributions compare equal, a doubled or partial one does not."""
    policy_version: int = Field(ge=0)
    """Version of the weights the gradient was taken at; reduction refuses to mix versions."""
    specs: tuple[TensorSpec, ...] = ()
    num_tokens: int = Field(default=0, ge=0)
    """Completion tokens the contribution covers."""
    parts: tuple[GradPart, ...] = ()
    """Each rank's rows, in rank order, when the weights are sharded (else empty)."""
    replica: int = Field(default=0, ge=0)
    """The data-parallel replica whose ranks wrote `parts` (a group's contribution; a step's
    reduced gradient has one part per rank of the run)."""


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


class PolicyRef(_Ref):
    """The weights of one policy version of a run: a committed checkpoint and the updates since.

    A process that holds the version in memory uses it as it is; any other process rebuilds it
    from `checkpoint` (weights, optimizer and trainer state) by applying `updates` in order with
    the run's optimizer — the same operations on the same bits, so the same weights.
    """

    run_id: str
    step: int = Field(ge=0)
    """Rollout steps completed at this version (the next step's index)."""
    policy_version: int = Field(ge=0)
    weights_digest: str
    """Identity of the weights: the checkpoint's digest at its own version, else derived from
    (checkpoint digest, version) without re-hashing."""
    checkpoint: CheckpointRef
    """The latest committed checkpoint at or before this version (the run's starting
    checkpoint before the first one is written)."""
    checkpoint_is_run_start: bool = False
    """True when `checkpoint` is the model the run started from (no optimizer state yet)."""
    updates: tuple[GradRef, ...] = ()
    """Reduced gradients applied since `checkpoint`, oldest first."""


class RolloutRef(_Ref):
    """A group's sampled responses and rewards, stored as a JSON record (`RolloutRecord`)."""

    uri: str
    """file:// URI of the record."""
    digest: str
    """sha256 of the record's bytes."""
    prompt: PromptRef
    step: int = Field(ge=0)
    rewards: list[float]
    """[G] (also in the record; here so that advantages need no read)."""
    seconds: dict[str, float] = Field(default_factory=dict)
    """Seconds spent producing it, by stage (rollout, reward)."""
    state_traffic: StateTraffic | None = None
    """The sampling's tiered-state peak and bytes read (None: the state resident)."""


class RolloutRecord(_Ref):
    """What a rollout produced for one group; every list has one entry per response."""

    prompt: PromptRef
    response_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    texts: list[str]
    truncated: list[bool]
    rewards: list[float]
    importance_weights: list[list[float]] | None = None
    """[G][R_i] truncated importance weights of imported responses (None for own rollouts)."""
    loss_masks: list[list[int]] | None = None
    """[G][R_i] 1 on the tokens the policy sampled, 0 on given ones (an agent trajectory's tool
    output and chat framing); None: every token counts."""
    finish_reasons: list[str] | None = None
    """[G] how each agent trajectory ended: done, max_turns, length or error."""
    num_turns: list[int] | None = None
    """[G] assistant turns of each agent trajectory."""
    errors: list[str | None] | None = None
    """[G] the environment's error that ended a trajectory (None where it did not fail)."""


class ScoresRef(_Ref):
    """No-grad log-probs [G][R_i] of a group's responses, stored as JSON."""

    uri: str
    digest: str
    which: str
    """"reference" (KL term) or "old" (the rollout policy, num_iterations > 1)."""
    seconds: float = 0.0
    state_traffic: StateTraffic | None = None
    """The scoring's tiered-state peak and bytes read (None: the state resident)."""


class BackwardResult(_Ref):
    """One group's gradient contribution and the statistics of its loss."""

    grad: GradRef
    stats: GroupStats


class PrefillReport(_Ref):
    """A prompt's state for one policy version and how much of it this call computed."""

    state: PrefixStateRef | None
    """The committed state; None when persistence is off (then only this process holds it)."""
    shards_computed: int
    shards_reused: int
    """Shards read back from storage (a resumed or repeated prefill) instead of computed."""
    seconds: float = 0.0


class UpdateResult(_Ref):
    """What an optimizer step produced."""

    policy: PolicyRef
    """The weights after the update."""
    policy_version: int
    """Version after the update."""
    grad_norm: float
    learning_rate: float
    clipped: bool
    seconds: float = 0.0
    trainable_parameters: int | None = None
    """Parameters the update changed: every parameter, or a LoRA run's adapters."""


__all__ = [
    "BackwardResult",
    "CheckpointRef",
    "GradRef",
    "PolicyRef",
    "PrefillReport",
    "PrefixStateRef",
    "PromptRef",
    "RolloutRecord",
    "RolloutRef",
    "ScoresRef",
    "ShardRef",
    "TensorSpec",
    "UpdateResult",
]
