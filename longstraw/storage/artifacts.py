"""A training step's small artifacts: rollout records, scores and gradient contributions.

Stages hand each other refs to these files, never the objects: a stage run in a fresh process
reads what an earlier stage wrote. Layout, under the run's local directory (checkpoints sit
beside it):

    steps/{step:06d}/rollout-g{index}.json         RolloutRecord
    steps/{step:06d}/scores-g{index}-{which}.json  [G][R_i] log-probs
    steps/{step:06d}/grads/{name}.safetensors      fp32 gradient by parameter name

Every file is written to a temporary sibling and renamed into place, so a reader never sees half
a file. A process-local cache keeps what this process wrote or read, by URI: the single-machine
path reads nothing back, and every rank of a sequence group can cache the same (replicated)
tensors under the URI only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import TypeVar

import torch
from pydantic import BaseModel
from safetensors.torch import load_file, save_file

from longstraw.schemas.refs import GradRef, TensorSpec
from longstraw.schemas.storage import StorageConfig
from longstraw.storage.checkpoints import run_dir
from longstraw.storage.errors import as_os_error

Model = TypeVar("Model", bound=BaseModel)

_lock = threading.Lock()
_json_cache: dict[str, BaseModel | list] = {}
_grad_cache: dict[str, dict[str, torch.Tensor]] = {}


class ArtifactMissingError(LookupError):
    """A ref names a file that does not exist (or no longer matches its digest)."""


def step_dir(storage: StorageConfig, run_id: str, step: int) -> Path:
    return run_dir(storage, run_id) / "steps" / f"{step:06d}"


def _uri(path: Path) -> str:
    return f"file://{path}"


def _path(uri: str) -> Path:
    if not uri.startswith("file://"):
        raise ValueError(f"{uri} is not a file:// artifact URI")
    return Path(uri[len("file://") :])


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        try:
            write(tmp)
        except Exception as err:
            if (mapped := as_os_error(err, path)) is err:
                raise
            raise mapped from err
        os.replace(tmp, path)
    finally:
        # On a volume that turned read-only the removal fails too; the write's error is the one.
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_json(path: Path, value: BaseModel | list, *, write: bool = True) -> tuple[str, str]:
    """(uri, sha256) of `value` as JSON at `path`; `write=False` only caches it (a rank whose
    replica rank 0 writes)."""
    data = (
        value.model_dump_json().encode()
        if isinstance(value, BaseModel)
        else json.dumps(value).encode()
    )
    if write:
        _atomic_write(path, lambda tmp: tmp.write_bytes(data))
    uri = _uri(path)
    with _lock:
        _json_cache[uri] = value
    return uri, hashlib.sha256(data).hexdigest()


def read_json(uri: str, digest: str, model: type[Model] | None = None) -> Model | list:
    """The value behind (uri, digest): from this process's cache, else read and checked."""
    with _lock:
        cached = _json_cache.get(uri)
    if cached is not None:
        return cached
    path = _path(uri)
    if not path.exists():
        raise ArtifactMissingError(
            f"{path} does not exist: the stage that writes it did not finish; rerun the step"
        )
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:
        raise ArtifactMissingError(
            f"{path} does not match its ref's digest (rewritten by another run of the step?); "
            "rerun the step from its rollout"
        )
    value = model.model_validate_json(data) if model is not None else json.loads(data)
    with _lock:
        _json_cache[uri] = value
    return value


def _fingerprint(tensor: torch.Tensor) -> list[float]:
    """Sum, sum of magnitudes and L2 norm in fp64, computed where the tensor lives."""
    stats = torch.stack(
        [
            tensor.sum(dtype=torch.float64),
            tensor.abs().sum(dtype=torch.float64),
            torch.linalg.vector_norm(tensor, dtype=torch.float64),
        ]
    )
    return stats.cpu().tolist()


def grads_digest(grads: dict[str, torch.Tensor]) -> str:
    """Digest of a gradient's content: names, shapes and per-tensor fp64 sum, magnitude and
    norm, computed on the tensors' device. Hashing every byte (sha256 of a 27 B-parameter fp32
    gradient, after a copy to the host) would put a full gradient pass on the hot path;
    identical contributions still compare equal and a doubled or partial one does not."""
    digest = hashlib.sha256()
    for name, tensor in sorted(grads.items()):
        digest.update(name.encode())
        digest.update(repr((tuple(tensor.shape), _fingerprint(tensor))).encode())
    return digest.hexdigest()


def write_grads(
    path: Path,
    grads: dict[str, torch.Tensor],
    *,
    policy_version: int,
    num_tokens: int,
    write: bool = True,
) -> GradRef:
    """Store an fp32 gradient as safetensors at `path` (and cache it); returns its ref."""
    if write:
        tensors = {name: g.detach().contiguous().cpu() for name, g in grads.items()}
        _atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))
    uri = _uri(path)
    with _lock:
        _grad_cache[uri] = grads
    specs = tuple(
        TensorSpec(name=n, shape=tuple(g.shape), dtype=str(g.dtype).removeprefix("torch."))
        for n, g in sorted(grads.items())
    )
    return GradRef(
        uri=uri,
        digest=grads_digest(grads),
        policy_version=policy_version,
        specs=specs,
        num_tokens=num_tokens,
    )


def rank_path(path: Path, rank: int, world_size: int) -> Path:
    """Rank `rank`'s file of a gradient sharded over `world_size` ranks."""
    return path.with_name(f"{path.stem}.rank{rank}-of-{world_size}{path.suffix}")


def read_grads(
    ref: GradRef, device: torch.device | str = "cpu", *, rank: int | None = None
) -> dict[str, torch.Tensor]:
    """The gradient behind `ref` — with `rank`, that rank's rows of a sharded one —: this
    process's cached tensors, else the file (checked against its digest)."""
    uri, digest = ref.uri, ref.digest
    if ref.parts:
        if rank is None or not 0 <= rank < len(ref.parts):
            raise ValueError(
                f"gradient {ref.uri} is sharded over {len(ref.parts)} ranks; this process is "
                f"rank {rank}: rerun the step's backward with the same parallel.world_size"
            )
        uri, digest = ref.parts[rank].uri, ref.parts[rank].digest
    with _lock:
        cached = _grad_cache.get(uri)
    if cached is not None:
        return cached
    path = _path(uri)
    if not path.exists():
        raise ArtifactMissingError(
            f"gradient {path} does not exist: the backward stage that writes it did not finish; "
            "rerun the step's backward"
        )
    grads = {name: t.to(device) for name, t in load_file(str(path)).items()}
    if grads_digest(grads) != digest:
        raise ArtifactMissingError(f"gradient {path} does not match its ref's digest")
    with _lock:
        _grad_cache[uri] = grads
    return grads


def forget_grads(ref: GradRef) -> None:
    """Drop a gradient (every rank's part) from this process's cache (the files stay)."""
    for uri in [ref.uri, *(part.uri for part in ref.parts)]:
        forget(uri)


def forget(uri: str) -> None:
    """Drop an artifact from this process's cache (the file stays)."""
    with _lock:
        _json_cache.pop(uri, None)
        _grad_cache.pop(uri, None)


def forget_run(storage: StorageConfig, run_id: str) -> None:
    """Drop every cached artifact of a run (as a fresh process would start)."""
    prefix = _uri(run_dir(storage, run_id))
    with _lock:
        for cache in (_json_cache, _grad_cache):
            for uri in [u for u in cache if u.startswith(prefix)]:
                del cache[uri]


def remove_step_gradients(storage: StorageConfig, run_id: str, before_step: int) -> int:
    """Delete the gradient files of steps < `before_step` (a checkpoint now covers them)."""
    steps = run_dir(storage, run_id) / "steps"
    removed = 0
    if not steps.exists():
        return 0
    for folder in steps.iterdir():
        if folder.name.isdigit() and int(folder.name) < before_step and (folder / "grads").exists():
            for file in (folder / "grads").iterdir():
                forget(_uri(file))
            shutil.rmtree(folder / "grads", ignore_errors=True)
            removed += 1
    return removed
