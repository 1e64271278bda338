"""Hugging Face checkpoint directories: loading, and the weights digest recorded beside them.

A prompt state is only valid for the weights it was computed with, so every checkpoint carries a
weights digest: the sha256 over its safetensors files, computed once when the checkpoint is
written and stored in `longstraw.json` (nothing re-hashes weights per step). A user's checkpoint
without that file gets it computed once on first load.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

METADATA_FILE = "longstraw.json"
_HASH_BLOCK = 1 << 22  # 4 MiB reads keep hashing a multi-GB checkpoint at disk speed


class CheckpointMetadata(BaseModel):
    """What LongStraw records beside a Hugging Face checkpoint directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    weights_digest: str
    """sha256 (hex) over the checkpoint's safetensors files, in sorted file-name order."""
    policy_version: int = Field(ge=0)
    """GRPO policy version: 0 for the initial checkpoint, +1 per optimizer step."""


def weights_digest_of(path: str | Path) -> str:
    """sha256 over every `*.safetensors` file in `path` (names and bytes, sorted by name)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors files in {path}: LongStraw loads safetensors checkpoints only"
        )
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as handle:
            while block := handle.read(_HASH_BLOCK):
                digest.update(block)
    return digest.hexdigest()


def write_checkpoint_metadata(path: str | Path, *, policy_version: int) -> CheckpointMetadata:
    """Hash the weights in `path` once and record digest + version in `longstraw.json` (atomic)."""
    meta = CheckpointMetadata(weights_digest=weights_digest_of(path), policy_version=policy_version)
    target = Path(path) / METADATA_FILE
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(meta.model_dump_json(indent=2))
    os.replace(tmp, target)
    return meta


def read_checkpoint_metadata(path: str | Path) -> CheckpointMetadata:
    """The recorded metadata, or (for a user's checkpoint) digest computed now at version 0."""
    target = Path(path) / METADATA_FILE
    if target.exists():
        return CheckpointMetadata.model_validate(json.loads(target.read_text()))
    return write_checkpoint_metadata(path, policy_version=0)


def load_checkpoint(
    path: str | Path, *, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, object, CheckpointMetadata]:
    """Load (model, tokenizer, metadata) from a HF directory exactly as a user's checkpoint loads."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(
            f"{path} is not a Hugging Face checkpoint directory (no config.json); "
            "create one with `longstraw init-model --family qwen3_5 --size tiny --out DIR`"
        )
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer, read_checkpoint_metadata(path)
