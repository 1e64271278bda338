"""Training checkpoints: a Hugging Face directory + optimizer and trainer state (no pickle).

Layout: `{root}/runs/{run_id}/checkpoints/v{policy_version:06d}/` holding what `from_pretrained`
loads (config.json, model.safetensors, tokenizer files), `longstraw.json` (weights digest and
policy version, hashed once here), `optimizer.safetensors` and
`trainer_state.json`. A checkpoint is written into a temporary sibling and renamed into place:
the rename is the commit, so a crash mid-write leaves no readable half checkpoint, and a retried
write of the same version keeps the first complete one.

Checkpoints live on the local filesystem (the storage root when it is local, else
`storage.local_dir`, e.g. a mounted volume); prompt states may be on S3.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from longstraw.models.checkpoint import write_checkpoint_metadata
from longstraw.schemas.refs import CheckpointRef
from longstraw.schemas.storage import StorageConfig

TRAINER_STATE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"


def local_root(storage: StorageConfig) -> Path:
    """The local directory for checkpoints and metrics: the storage root when it is local,
    `storage.local_dir` when prompt states go to object storage."""
    if storage.root_uri.startswith("file://"):
        return Path(storage.root_uri[len("file://") :])
    return Path(storage.local_dir).expanduser().resolve()


def run_dir(storage: StorageConfig, run_id: str) -> Path:
    return local_root(storage) / "runs" / run_id


def checkpoints_dir(storage: StorageConfig, run_id: str) -> Path:
    return run_dir(storage, run_id) / "checkpoints"


def save_training_checkpoint(
    storage: StorageConfig,
    run_id: str,
    *,
    policy_version: int,
    model,
    tokenizer,
    optimizer_tensors: dict[str, torch.Tensor],
    trainer_state: dict,
) -> CheckpointRef:
    """Write and commit checkpoint `policy_version` of `run_id`; returns its ref."""
    final = checkpoints_dir(storage, run_id) / f"v{policy_version:06d}"
    if final.exists():
        # A retried task: the first complete write stands.
        return checkpoint_ref(final)
    tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        save_file(optimizer_tensors, str(tmp / OPTIMIZER_FILE))
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
        write_checkpoint_metadata(tmp, policy_version=policy_version)
        os.rename(tmp, final)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.exists():
            raise
    return checkpoint_ref(final)


def checkpoint_ref(path: Path) -> CheckpointRef:
    meta = json.loads((path / "longstraw.json").read_text())
    return CheckpointRef(
        uri=f"file://{path}",
        weights_digest=meta["weights_digest"],
        policy_version=meta["policy_version"],
    )


def latest_checkpoint(storage: StorageConfig, run_id: str) -> Path | None:
    """The committed checkpoint with the highest policy version, or None."""
    folder = checkpoints_dir(storage, run_id)
    if not folder.exists():
        return None
    done = sorted(
        p
        for p in folder.iterdir()
        if p.is_dir() and p.name.startswith("v") and ".tmp-" not in p.name
    )
    return done[-1] if done else None


def load_training_state(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(optimizer tensors, trainer state) of a committed checkpoint."""
    return (
        load_file(str(path / OPTIMIZER_FILE)),
        json.loads((path / TRAINER_STATE).read_text()),
    )
