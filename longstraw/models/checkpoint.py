"""Hugging Face checkpoint directories: loading, and the weights digest recorded beside them.

A prompt state is only valid for the weights it was computed with, so every checkpoint carries a
weights digest: the sha256 over its safetensors files, computed once when the checkpoint is
written and stored in `longstraw.json` (nothing re-hashes weights per step). A user's checkpoint
without that file is hashed once on first load, and the result is recorded under the run's
storage (`record_dir`), never in the user's directory: a read-only model volume works, and the
record is used again while the weights files keep their sizes and modification times.

The same pass records every file's size and sha256 (`files`), so a reader can tell a damaged or
truncated checkpoint from a good one (`verify_checkpoint_files`) instead of training on it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from longstraw.errors import UserError
from longstraw.models.kernels import quiet_kernel_fallbacks

METADATA_FILE = "longstraw.json"
_HASH_BLOCK = 1 << 22  # 4 MiB reads keep hashing a multi-GB checkpoint at disk speed


class FileRecord(BaseModel):
    """Size and sha256 of one file of a checkpoint, recorded when it was written."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size: int = Field(ge=0)
    sha256: str


class CheckpointDamagedError(UserError):
    """A checkpoint file is missing, truncated or altered since the checkpoint was written."""

    def __init__(self, path: Path, detail: str):
        self.path = path
        self.detail = detail
        super().__init__(
            f"checkpoint file {path} {detail} — restore it, or continue the run with --resume "
            "(which falls back to the newest checkpoint that verifies)"
        )


class CheckpointMetadata(BaseModel):
    """What LongStraw records beside a Hugging Face checkpoint directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    weights_digest: str
    """sha256 (hex) over the checkpoint's safetensors files, in sorted file-name order."""
    policy_version: int = Field(ge=0)
    """GRPO policy version: 0 for the initial checkpoint, +1 per optimizer step."""
    files: dict[str, FileRecord] | None = None
    """Every file of the directory but this record, by name (None: written before files were
    recorded; such a checkpoint is not verified)."""
    base_weights_digest: str | None = None
    """A LoRA checkpoint (peft adapter files): the weights digest of the base it was trained on,
    which `weights_digest` includes (None: a whole model)."""


def weights_digest_of(path: str | Path) -> str:
    """sha256 over every `*.safetensors` file in `path` (names and bytes, sorted by name)."""
    return _hash_checkpoint(Path(path), record_files=False)[0]


def _hash_checkpoint(path: Path, *, record_files: bool) -> tuple[str, dict[str, FileRecord]]:
    """(weights digest, per-file records) in one read of each file."""
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ValueError(
            f"no *.safetensors files in {path}: LongStraw loads safetensors checkpoints only"
        )
    others = (
        sorted(f for f in path.iterdir() if f.is_file() and f.suffix != ".safetensors")
        if record_files
        else []
    )
    digest = hashlib.sha256()
    records: dict[str, FileRecord] = {}
    for file in weights + others:
        if file.name.startswith(METADATA_FILE):
            continue  # the record itself (and its temporary file)
        is_weights = file.suffix == ".safetensors"
        if is_weights:
            digest.update(file.name.encode())
        own, size = hashlib.sha256(), 0
        with open(file, "rb") as handle:
            while block := handle.read(_HASH_BLOCK):
                size += len(block)
                if is_weights:
                    digest.update(block)
                if record_files:
                    own.update(block)
        if record_files:
            records[file.name] = FileRecord(size=size, sha256=own.hexdigest())
    return digest.hexdigest(), records


def checkpoint_metadata_of(
    path: str | Path, *, policy_version: int, base_weights_digest: str | None = None
) -> CheckpointMetadata:
    """Hash the checkpoint in `path`: weights digest and every file's size and sha256. An
    adapter checkpoint (`base_weights_digest` of its base given) is identified by both: its
    weights digest is the sha256 of the base's digest and its own files' digest."""
    digest, files = _hash_checkpoint(Path(path), record_files=True)
    if base_weights_digest is not None:
        digest = hashlib.sha256(f"{base_weights_digest}:{digest}".encode()).hexdigest()
    return CheckpointMetadata(
        weights_digest=digest,
        policy_version=policy_version,
        files=files,
        base_weights_digest=base_weights_digest,
    )


def write_checkpoint_metadata(
    path: str | Path, *, policy_version: int, base_weights_digest: str | None = None
) -> CheckpointMetadata:
    """Hash the checkpoint in `path` once and record it in its `longstraw.json` (atomic)."""
    meta = checkpoint_metadata_of(
        path, policy_version=policy_version, base_weights_digest=base_weights_digest
    )
    target = Path(path) / METADATA_FILE
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(meta.model_dump_json(indent=2))
    os.replace(tmp, target)
    return meta


def verify_checkpoint_files(path: str | Path, meta: CheckpointMetadata) -> None:
    """Raise CheckpointDamagedError naming the first file of `path` that is missing, has another
    size (truncated) or another sha256 than `meta` recorded. Reads every recorded file once."""
    path = Path(path)
    for name, record in sorted((meta.files or {}).items()):
        file = path / name
        if not file.is_file():
            raise CheckpointDamagedError(file, "is missing")
        size = file.stat().st_size
        if size != record.size:
            raise CheckpointDamagedError(
                file, f"has {size} bytes, {record.size} were written (truncated or replaced)"
            )
        digest = hashlib.sha256()
        with open(file, "rb") as handle:
            while block := handle.read(_HASH_BLOCK):
                digest.update(block)
        if digest.hexdigest() != record.sha256:
            raise CheckpointDamagedError(
                file, f"has sha256 {digest.hexdigest()[:12]}…, {record.sha256[:12]}… was written"
            )


def _weights_stat(path: Path) -> dict[str, list[int]]:
    """{file name: [size, mtime_ns]} of the weights files: what tells a record is still current."""
    return {
        f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(path.glob("*.safetensors"))
    }


def metadata_record_path(path: str | Path, record_dir: str | Path) -> Path:
    """Where the metadata of the user's checkpoint `path` is recorded under `record_dir`."""
    resolved = str(Path(path).expanduser().resolve())
    key = hashlib.sha256(resolved.encode()).hexdigest()[:24]
    return Path(record_dir) / f"{Path(resolved).name or 'checkpoint'}-{key}.json"


# Process-local: a user's checkpoint hashed without a record_dir is hashed once per process.
_COMPUTED: dict[tuple[str, str], CheckpointMetadata] = {}


def read_checkpoint_metadata(
    path: str | Path, *, record_dir: str | Path | None = None
) -> CheckpointMetadata:
    """The checkpoint's `longstraw.json` (LongStraw's own checkpoints); for a user's checkpoint
    without one, its record under `record_dir` while the weights files are unchanged, else its
    digest computed now at version 0 (and recorded under `record_dir`). Never writes into
    `path`."""
    path = Path(path)
    target = path / METADATA_FILE
    if target.exists():
        return CheckpointMetadata.model_validate(json.loads(target.read_text()))
    stat = _weights_stat(path)
    key = (str(path.resolve()), json.dumps(stat, sort_keys=True))
    record = metadata_record_path(path, record_dir) if record_dir is not None else None
    if record is not None and record.is_file():
        try:
            saved = json.loads(record.read_text())
            if saved.get("weights_stat") == stat:
                return CheckpointMetadata.model_validate(saved["metadata"])
        except (OSError, ValueError, KeyError):
            pass  # an unreadable or old record is computed again
    meta = _COMPUTED.get(key)
    if meta is None:
        meta = _COMPUTED[key] = checkpoint_metadata_of(path, policy_version=0)
    if record is not None:
        record.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "checkpoint": key[0],
            "weights_stat": stat,
            "metadata": meta.model_dump(mode="json"),
        }
        tmp = record.with_name(f"{record.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(body, indent=2))
        os.replace(tmp, record)
    return meta


def load_checkpoint(
    path: str | Path, *, dtype: torch.dtype = torch.float32, record_dir: str | Path | None = None
) -> tuple[PreTrainedModel, object, CheckpointMetadata]:
    """Load (model, tokenizer, metadata) from a HF directory exactly as a user's checkpoint loads
    (`record_dir`: see `read_checkpoint_metadata`)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(
            f"{path} is not a Hugging Face checkpoint directory (no config.json); "
            "create one with `longstraw init-model --family qwen3_5 --size tiny --out DIR`"
        )
    # LongStraw names missing kernels once per run (`longstraw train`), not transformers per call.
    quiet_kernel_fallbacks()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer, read_checkpoint_metadata(path, record_dir=record_dir)
