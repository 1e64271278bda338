"""Storage contracts: where a prompt state lives, how it is laid out, and what its manifests say.

No torch here. Shapes use the legend of the engine's prompt state:
    L  layers of one kind      T  prompt tokens        S  prefill shards
    token array       [L, T, ...]     one chunk per shard along T (the last one partial)
    checkpoint array  [L, S + 1, ...] index s = state at the start of shard s, index S = final state
"""

from __future__ import annotations

import math
import os
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Digests, run ids and array names become path components: forbid separators and dot-dot tricks.
_PATH_SAFE = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_ARRAY_NAME = r"^[A-Za-z0-9_]+(/[A-Za-z0-9_]+)*$"

LogicalDType = Literal["float32", "bfloat16", "float16"]
PersistMode = Literal["off", "background", "synchronous"]

_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


def _default_s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


class StorageConfig(_Frozen):
    """Where prompt states are persisted and how writes overlap compute."""

    root_uri: str = Field(default="./.longstraw", validate_default=True)
    """Root of the key space: a local path (resolved to an absolute file:// URI) or s3://bucket/prefix."""
    local_dir: str = "./.longstraw"
    """Local directory for checkpoints, metrics and built demo models when `root_uri` is not a
    local path (prompt states go to `root_uri`, e.g. s3://; checkpoints stay on a local or
    mounted volume). Ignored for a local `root_uri`, which holds everything."""
    persist_mode: PersistMode = "background"
    """off: keep the state in process memory only; background: a writer thread overlaps compute;
    synchronous: write_shard returns once the shard is durable."""
    max_inflight_bytes: int = Field(default=2 * 2**30, gt=0)
    """Background mode: bytes queued but not yet written; write_shard blocks above this (2 GiB
    bounds the extra host memory to about one large shard)."""
    s3_endpoint_url: str | None = Field(default_factory=_default_s3_endpoint)
    """S3-compatible endpoint (e.g. http://127.0.0.1:9000); taken from AWS_ENDPOINT_URL_S3 by default."""
    s3_read_timeout_s: float = Field(default=30.0, gt=0)
    """Longest wait for an S3 request's answer (each read of the socket); then a warning line
    and a retry with backoff."""
    s3_connect_timeout_s: float = Field(default=10.0, gt=0)
    """Longest wait for a connection to the S3 endpoint; then a warning line and a retry."""
    s3_max_attempts: int = Field(default=5, ge=1)
    """Attempts of one S3 request (botocore's standard retry mode: exponential backoff with
    jitter, at most 20 s between attempts); after the last the run stops with one error line."""
    uncommitted_grace_seconds: float = Field(default=3600.0, ge=0)
    """gc leaves an uncommitted attempt alone until its newest object is this old (a live writer
    touches its attempt at least once per shard)."""

    @field_validator("root_uri")
    @classmethod
    def _resolve_root(cls, value: str) -> str:
        value = value.rstrip("/") or "/"
        if "://" not in value:
            return "file://" + str(Path(value).expanduser().resolve())
        protocol = value.split("://", 1)[0]
        if protocol not in ("file", "s3", "memory"):
            raise ValueError(
                f"root_uri {value!r}: use a local path, file:// or s3:// (got protocol {protocol!r})"
            )
        if protocol == "file":
            return "file://" + str(Path(value[len("file://") :]).expanduser().resolve())
        return value


class StateKey(_Frozen):
    """Identity of one prompt state: a policy state (run, version) or a reference-model state."""

    kind: Literal["policy", "reference"]
    """policy: recomputed at every policy version; reference: keyed by weights digest only (the
    reference model never changes across steps)."""
    weights_digest: str = Field(pattern=_PATH_SAFE)
    """Digest of the weights the state was computed with; checked on every read."""
    prompt_digest: str = Field(pattern=_PATH_SAFE)
    """Digest of the prompt tokens (and of anything else that changes the state)."""
    run_id: str | None = Field(default=None, pattern=_PATH_SAFE)
    """policy only: the training run."""
    policy_version: int | None = Field(default=None, ge=0)
    """policy only: the optimizer step whose weights computed the state."""

    @model_validator(mode="after")
    def _check_kind(self) -> StateKey:
        if self.kind == "policy" and (self.run_id is None or self.policy_version is None):
            raise ValueError("a policy StateKey needs run_id and policy_version")
        if self.kind == "reference" and (
            self.run_id is not None or self.policy_version is not None
        ):
            raise ValueError(
                "a reference StateKey is keyed by weights_digest only: drop run_id/policy_version"
            )
        return self

    @classmethod
    def policy(
        cls, run_id: str, policy_version: int, weights_digest: str, prompt_digest: str
    ) -> StateKey:
        return cls(
            kind="policy",
            run_id=run_id,
            policy_version=policy_version,
            weights_digest=weights_digest,
            prompt_digest=prompt_digest,
        )

    @classmethod
    def reference(cls, weights_digest: str, prompt_digest: str) -> StateKey:
        return cls(kind="reference", weights_digest=weights_digest, prompt_digest=prompt_digest)


class ArraySpec(_Frozen):
    """One named tensor of a prompt state."""

    name: str = Field(pattern=_ARRAY_NAME)
    """Array path inside state.zarr, e.g. full_attention/k."""
    kind: Literal["token", "checkpoint"]
    """token: [L, T, ...] appended per shard; checkpoint: [L, S + 1, ...] one entry per shard boundary."""
    shape: tuple[int, ...]
    """[L, T, ...] for token arrays, [L, S + 1, ...] for checkpoint arrays."""
    dtype: LogicalDType
    """Logical dtype; bfloat16 is stored as its uint16 bit pattern."""
    layers_per_chunk: int | None = Field(default=None, gt=0)
    """Layers in one chunk (None: all). Smaller chunks keep single objects under S3's 5 GB PUT
    limit at real scale; along the token/shard axis a chunk is always one shard."""

    @field_validator("shape")
    @classmethod
    def _check_shape(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) < 2 or any(d <= 0 for d in shape):
            raise ValueError(f"shape {shape}: need [L, T or S+1, ...] with positive sizes")
        return shape

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def stored_dtype(self) -> str:
        """NumPy dtype of the stored bytes."""
        return "uint16" if self.dtype == "bfloat16" else self.dtype

    def chunk_shape(self, shard_tokens: int) -> tuple[int, ...]:
        layers = self.shape[0] if self.layers_per_chunk is None else self.layers_per_chunk
        along = shard_tokens if self.kind == "token" else 1
        return (min(layers, self.shape[0]), along, *self.shape[2:])

    def chunk_nbytes(self, shard_tokens: int) -> int:
        """Bytes of one stored chunk (edge chunks are stored padded to this size)."""
        return math.prod(self.chunk_shape(shard_tokens)) * self.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


class StateLayout(_Frozen):
    """Every array of a prompt state and how the prompt is cut into prefill shards."""

    arrays: tuple[ArraySpec, ...]
    """The state's arrays; names are unique."""
    num_tokens: int = Field(gt=0)
    """T: prompt positions the state covers."""
    shard_tokens: int = Field(gt=0)
    """Tokens per prefill shard (the last shard may be shorter)."""
    num_shards: int = Field(gt=0)
    """S = ceil(T / shard_tokens)."""

    @model_validator(mode="after")
    def _check(self) -> StateLayout:
        expected = math.ceil(self.num_tokens / self.shard_tokens)
        if self.num_shards != expected:
            raise ValueError(
                f"num_shards={self.num_shards} but ceil(num_tokens / shard_tokens) = {expected}"
            )
        names = [a.name for a in self.arrays]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"array names must be unique and non-empty, got {names}")
        for a in self.arrays:
            along = self.num_tokens if a.kind == "token" else self.num_shards + 1
            if a.shape[1] != along:
                what = "T" if a.kind == "token" else "S + 1"
                raise ValueError(f"{a.name}: shape[1] = {a.shape[1]} but {what} = {along}")
        return self

    @classmethod
    def build(cls, arrays: list[ArraySpec], num_tokens: int, shard_tokens: int) -> StateLayout:
        return cls(
            arrays=tuple(arrays),
            num_tokens=num_tokens,
            shard_tokens=shard_tokens,
            num_shards=math.ceil(num_tokens / shard_tokens),
        )

    def array(self, name: str) -> ArraySpec:
        for a in self.arrays:
            if a.name == name:
                return a
        raise KeyError(name)

    def shard_range(self, k: int) -> tuple[int, int]:
        """[start, end) token positions of shard k."""
        if not 0 <= k < self.num_shards:
            raise ValueError(f"shard index {k} outside [0, {self.num_shards})")
        start = k * self.shard_tokens
        return start, min(start + self.shard_tokens, self.num_tokens)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class ChunkDigest(_Frozen):
    """One stored chunk object and the sha256 of its raw bytes."""

    array: str
    """Array name."""
    index: tuple[int, ...]
    """Chunk grid coordinates, e.g. (layer_chunk, shard, 0, 0)."""
    nbytes: int
    """Size of the stored object."""
    sha256: str
    """Hex sha256 of the stored object's bytes."""


class ShardManifest(_Frozen):
    """shards/{k:05d}.json: shard k's chunks are complete and verified, in the named attempt."""

    shard_index: int
    """k."""
    token_start: int
    """First token position of the shard."""
    token_end: int
    """One past the last token position of the shard."""
    attempt_id: str
    """The writer attempt whose state.zarr holds (and computed) this shard's chunks."""
    chunks: tuple[ChunkDigest, ...]
    """Every chunk this shard owns: its token chunks and checkpoint index k + 1 (and 0 for k = 0)."""
    written_at: datetime
    """UTC time the manifest was created."""


class StateManifest(_Frozen):
    """COMMITTED.json: the only entry point for readers of a finished prompt state."""

    format_version: Literal[1] = 1
    """Layout version of this manifest."""
    key: StateKey
    """Identity of the state (also gives run id for policy states)."""
    weights_digest: str
    """Weights the state was computed with."""
    policy_version: int | None
    """Policy version (None for a reference state)."""
    prompt_digest: str
    """Prompt the state covers."""
    num_tokens: int
    """T."""
    shard_tokens: int
    """Tokens per shard."""
    attempt_id: str
    """The attempt that committed (shards may live in earlier attempts of a resumed prefill)."""
    layout: StateLayout
    """Arrays with logical dtypes and shapes."""
    shards: tuple[ShardManifest, ...]
    """Shard manifests 0..S-1 as committed: attempt and per-chunk sha256 of each shard."""
    code_version: str
    """longstraw.__version__ of the committing writer."""
    created_at: datetime
    """UTC commit time."""


class PrefixStateRef(_Frozen):
    """Small pointer to a committed prompt state; what tasks pass around instead of tensors."""

    uri: str
    """URI of the committed state directory (the one holding COMMITTED.json)."""
    manifest_sha256: str
    """sha256 of the COMMITTED.json bytes; also the process-cache key."""
    policy_version: int | None
    """Policy version (None for a reference state)."""
    weights_digest: str
    """Weights the state was computed with."""
    prompt_digest: str
    """Prompt the state covers."""
    num_tokens: int
    """T."""


# --- sweep checkpoints --------------------------------------------------------------------------
#
# Exact mode's reverse sweep persists what the rest of it needs every so often (docs/engine.md,
# "A sweep resumed"): per rank, one flat fp32 array of its tensors.


class SweepKey(_Frozen):
    """Everything a group's backward (replay + reverse sweep) depends on: a sweep checkpoint is
    resumed only by a backward with an equal key. The digests are sha256 of canonical JSON."""

    run_id: str = Field(pattern=_PATH_SAFE)
    policy_version: int = Field(ge=0)
    weights_digest: str = Field(pattern=_PATH_SAFE)
    """The weights replayed and swept."""
    prompt_digest: str = Field(pattern=_PATH_SAFE)
    """The prompt whose state is swept."""
    num_shards: int = Field(gt=0)
    """Prefill shards of that state."""
    group: int = Field(ge=0)
    """The group's prompt index in the run."""
    iteration: int = Field(ge=0)
    """Which update on the step's rollouts (`grpo.num_iterations`)."""
    responses: str
    """The rollout record's digest: the responses replayed."""
    advantages: str
    """Digest of the group's advantages, loss masks, the step's normalisers and the old /
    reference log-probs."""
    loss_config: str
    """Digest of the `grpo` section."""
    engine: str
    """Digest of the `engine` settings that change the numbers (prompt gradient, shard size,
    segments, shared prefixes)."""
    model: str
    """Digest of the `model` section (dtype, LoRA's settings: which parameters train, so what
    the gradient accumulators hold)."""
    adapters: str | None = None
    """A LoRA run's adapters where `weights_digest` does not name them: "drawn from train.seed
    N" while the policy descends from the run's start (whose digest is the frozen base's, the
    adapters' initial values drawn from the seed). None: every parameter trains, or the
    adapters come from a checkpoint whose digest covers them."""
    placement: str
    """The ranks the backward ran on, e.g. "2 sequence ranks" (a checkpoint holds each rank's
    part)."""

    def first_difference(self, current: SweepKey) -> str | None:
        """How this (a checkpoint's) key differs from `current`'s, naming the first field that
        does: "its loss config differs (3f2a9c01d5e7… there, 91bc0d42aa10… now)"; None: equal."""
        for name in type(self).model_fields:
            there, now = getattr(self, name), getattr(current, name)
            if there != now:
                what = name.replace("_", " ")
                return f"its {what} differs ({_short(there)} there, {_short(now)} now)"
        return None


def _short(value) -> str:
    text = str(value)
    return text[:12] + "…" if len(text) > 16 else text


class FlatTensorEntry(_Frozen):
    """One tensor inside a part's flat array: elements [offset, offset + prod(shape))."""

    name: str
    shape: tuple[int, ...]
    offset: int = Field(ge=0)


class SweepCheckpointPart(_Frozen):
    """One rank's part of a sweep checkpoint: its tensors, packed in order into one flat fp32
    Zarr array `tensors` of `part-{rank}-of-{ranks}.zarr`, chunked every `chunk_elements`."""

    rank: int = Field(ge=0)
    """The rank's index among the ranks of the backward stage."""
    tensors: tuple[FlatTensorEntry, ...]
    num_elements: int = Field(ge=0)
    chunk_elements: int = Field(gt=0)
    chunks: tuple[ChunkDigest, ...]
    """Every chunk of the flat array with its sha256 (index (j,))."""


class SweepCheckpointManifest(_Frozen):
    """checkpoints/{swept:05d}.json of a sweep: created exclusively once every rank's part is
    written and verified; the only entry point of a reader."""

    format_version: Literal[1] = 1
    key: SweepKey
    swept: int = Field(gt=0)
    """Shards swept before it (the last `swept` of `key.num_shards`): the sweep continues at
    shard `num_shards - 1 - swept`."""
    attempt_id: str
    """attempt-{id}/ holds every part's Zarr array."""
    parts: tuple[SweepCheckpointPart, ...]
    """One per rank, in rank order."""
    record: dict
    """What replay recorded besides gradients (log-probs, losses, loss statistics), as JSON:
    a resumed backward does not replay again."""
    code_version: str
    created_at: datetime
