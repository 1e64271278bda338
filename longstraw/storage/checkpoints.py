"""Training checkpoints: a Hugging Face directory + optimizer and trainer state (no pickle).

Layout: `{root}/runs/{run_id}/checkpoints/v{policy_version:06d}/` holding what `from_pretrained`
loads (config.json, model.safetensors, tokenizer files), `longstraw.json` (weights digest and
policy version, hashed once here), the optimizer state and `trainer_state.json`. A LoRA run's
checkpoint holds its adapters in peft's format instead of the model (adapter_config.json,
adapter_model.safetensors: `PeftModel.from_pretrained` loads them on the base) and the
optimizer state of the adapters alone.

The optimizer state is `optimizer.safetensors` when one process trained, or one
`optimizer-rank{r}-of-{N}.safetensors` per rank when the weights were sharded at rest over N
ranks: each holds rank r's dim-0 rows (`torch.chunk` layout) of every row tensor (moments and
fp32 masters) and the same scalars (steps). `load_optimizer_rows` reads any row range from
either form, so a run resumes on any number of ranks. A checkpoint is written into a temporary sibling and renamed into place:
the rename is the commit, so a crash mid-write leaves no readable half checkpoint, and a retried
write of the same version keeps the first complete one.

`longstraw.json` records every file's size and sha256; `valid_checkpoint` checks them before a run
resumes from a checkpoint, and `latest_valid_checkpoint` moves a damaged one aside
(`v000002.damaged-<id>`, kept for inspection) and falls back to the one before it.

Checkpoints live on the local filesystem (the storage root when it is local, else
`storage.local_dir`, e.g. a mounted volume); prompt states may be on S3.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from longstraw.models.checkpoint import (
    METADATA_FILE,
    CheckpointDamagedError,
    CheckpointMetadata,
    verify_checkpoint_files,
    write_checkpoint_metadata,
)
from longstraw.models.lora import save_weights
from longstraw.schemas.refs import CheckpointRef
from longstraw.schemas.storage import StorageConfig
from longstraw.storage.errors import as_os_error

TRAINER_STATE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
_OPTIMIZER_PART = re.compile(r"optimizer-rank(\d+)-of-(\d+)\.safetensors")
# Keys of the optimizer state that are the same on every rank (not split into rows).
_SCALAR_PREFIXES = ("step/", "meta/")
_COMMITTED_NAME = re.compile(r"v\d{6}")
"""A committed checkpoint's directory name (temporaries: `.tmp-<id>`, set aside: `.damaged-<id>`)."""

logger = logging.getLogger("longstraw.checkpoints")


def local_root(storage: StorageConfig) -> Path:
    """The local directory for checkpoints and metrics: the storage root when it is local,
    `storage.local_dir` when prompt states go to object storage."""
    if storage.root_uri.startswith("file://"):
        return Path(storage.root_uri[len("file://") :])
    return Path(storage.local_dir).expanduser().resolve()


def run_dir(storage: StorageConfig, run_id: str) -> Path:
    return local_root(storage) / "runs" / run_id


def run_started(storage: StorageConfig, run_id: str) -> bool:
    """Whether the run has left anything under its directory but its lease (`RUN.lock`, which
    the process asking holds): prompt states, metrics, checkpoints."""
    folder = run_dir(storage, run_id)
    return folder.is_dir() and any(p.name != "RUN.lock" for p in folder.iterdir())


def checkpoints_dir(storage: StorageConfig, run_id: str) -> Path:
    return run_dir(storage, run_id) / "checkpoints"


def checkpoint_path(storage: StorageConfig, run_id: str, policy_version: int) -> Path:
    """Where checkpoint `policy_version` of `run_id` is committed."""
    return checkpoints_dir(storage, run_id) / f"v{policy_version:06d}"


def new_checkpoint_dir(final: Path) -> Path:
    """A fresh temporary sibling of `final` to write a checkpoint into."""
    tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    return tmp


def optimizer_part_name(rank: int, world_size: int) -> str:
    return f"optimizer-rank{rank}-of-{world_size}.safetensors"


def save_optimizer_part(tmp: Path, tensors: dict[str, torch.Tensor], rank: int, world: int):
    """Rank `rank`'s optimizer rows into the checkpoint being written (`world` ranks)."""
    name = OPTIMIZER_FILE if world == 1 else optimizer_part_name(rank, world)
    try:
        save_file(tensors, str(tmp / name))
    except Exception as err:
        if (mapped := as_os_error(err, tmp)) is err:
            raise
        raise mapped from err


def process_umask() -> int:
    """This process's umask, read without changing it (`os.umask` sets it process-wide, racing
    with threads that create files meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_per_umask(folder: Path) -> None:
    """Give every file under `folder` the mode a newly created file gets (0666 & ~umask).

    safetensors writes its files 0600 whatever the umask, so weights and optimizer state on a
    shared volume would be unreadable to the team's other users."""
    mode = 0o666 & ~process_umask()
    for file in folder.rglob("*"):
        if file.is_file():
            file.chmod(mode)


def commit_checkpoint(
    tmp: Path,
    final: Path,
    *,
    policy_version: int,
    model,
    tokenizer,
    trainer_state: dict,
    state_dict: dict[str, torch.Tensor] | None = None,
    base_weights_digest: str | None = None,
) -> CheckpointRef:
    """Write the model, tokenizer and trainer state into `tmp` (its optimizer files are there
    already) and rename it to `final`: the rename is the commit. `state_dict`: the full weights
    when `model`'s own parameters are sharded. A LoRA policy (peft's `PeftModel`) writes its
    adapters in peft's format, recorded with its base's `base_weights_digest`."""
    try:
        try:
            save_weights(model, tmp, state_dict)
        except Exception as err:
            if (mapped := as_os_error(err, tmp)) is err:
                raise
            raise mapped from err
        tokenizer.save_pretrained(str(tmp))
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
        write_checkpoint_metadata(
            tmp, policy_version=policy_version, base_weights_digest=base_weights_digest
        )
        share_per_umask(tmp)
        os.rename(tmp, final)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.exists():
            raise
    except BaseException:
        # No half-written checkpoint stays behind (a full disk gets its space back at once).
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return checkpoint_ref(final)


def save_training_checkpoint(
    storage: StorageConfig,
    run_id: str,
    *,
    policy_version: int,
    model,
    tokenizer,
    optimizer_tensors: dict[str, torch.Tensor],
    trainer_state: dict,
    base_weights_digest: str | None = None,
) -> CheckpointRef:
    """Write and commit checkpoint `policy_version` of `run_id` (one process); returns its ref
    (`base_weights_digest`: a LoRA policy's base, `commit_checkpoint`)."""
    final = checkpoint_path(storage, run_id, policy_version)
    if final.exists():
        # A retried task: the first complete write stands.
        return checkpoint_ref(final)
    tmp = new_checkpoint_dir(final)
    try:
        save_optimizer_part(tmp, optimizer_tensors, 0, 1)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_checkpoint(
        tmp,
        final,
        policy_version=policy_version,
        model=model,
        tokenizer=tokenizer,
        trainer_state=trainer_state,
        base_weights_digest=base_weights_digest,
    )


def _strip_optimizer_state(path: Path) -> None:
    """Remove a committed checkpoint's optimizer files, and their entries from its file record
    first (atomic rewrite), so that it still verifies, as a weights-only checkpoint."""
    parts = [path / OPTIMIZER_FILE, *path.glob("optimizer-rank*-of-*.safetensors")]
    parts = [part for part in parts if part.exists()]
    if not parts:
        return
    record = path / METADATA_FILE
    meta = CheckpointMetadata.model_validate_json(record.read_bytes())
    if meta.files is not None:
        names = {part.name for part in parts}
        meta = meta.model_copy(
            update={"files": {n: f for n, f in meta.files.items() if n not in names}}
        )
        tmp = record.with_suffix(".json.tmp")
        tmp.write_text(meta.model_dump_json(indent=2))
        os.replace(tmp, record)
    for part in parts:
        part.unlink(missing_ok=True)


def has_optimizer_state(path: Path) -> bool:
    """Whether a committed checkpoint can be resumed from (not weights-only)."""
    return (path / OPTIMIZER_FILE).exists() or any(path.glob("optimizer-rank*-of-*.safetensors"))


def checkpoint_ref(path: Path) -> CheckpointRef:
    meta = json.loads((path / "longstraw.json").read_text())
    return CheckpointRef(
        uri=f"file://{path}",
        weights_digest=meta["weights_digest"],
        policy_version=meta["policy_version"],
    )


def committed_checkpoints(storage: StorageConfig, run_id: str) -> list[Path]:
    """The run's committed checkpoints, oldest first."""
    folder = checkpoints_dir(storage, run_id)
    if not folder.exists():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and _COMMITTED_NAME.fullmatch(p.name))


def latest_checkpoint(storage: StorageConfig, run_id: str) -> Path | None:
    """The committed checkpoint with the highest policy version, or None (not verified)."""
    done = committed_checkpoints(storage, run_id)
    return done[-1] if done else None


_verified: set[tuple] = set()
"""(checkpoint path, its record's sha256, its files' sizes and mtimes) verified by this process:
an unchanged checkpoint is hashed once per process."""


def valid_checkpoint(path: Path) -> CheckpointMetadata:
    """The checkpoint's metadata once every recorded file matches its size and sha256; raises
    CheckpointDamagedError naming the first file that does not (or an unreadable record)."""
    record = path / METADATA_FILE
    try:
        raw = record.read_bytes()
        meta = CheckpointMetadata.model_validate_json(raw)
    except (OSError, ValueError) as err:
        raise CheckpointDamagedError(record, f"is unreadable ({type(err).__name__})") from err
    # A file rewritten since it was verified (another size or mtime) is hashed again.
    stats = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.iterdir()))
    key = (str(path), hashlib.sha256(raw).hexdigest(), stats)
    if key not in _verified:
        verify_checkpoint_files(path, meta)
        _verified.add(key)
    return meta


def latest_valid_checkpoint(storage: StorageConfig, run_id: str) -> Path | None:
    """The newest committed checkpoint whose files verify, or None. Each damaged one newer than
    it is renamed to `<name>.damaged-<id>` (so the step that made it can commit it again) and
    named in a warning."""
    for path in reversed(committed_checkpoints(storage, run_id)):
        if not has_optimizer_state(path):
            # Weights only (`train.save_total_limit` removed its optimizer state): not a resume
            # point, and not damaged either.
            logger.warning(
                "warning: checkpoint %s holds weights only (its optimizer state was removed by "
                "train.save_total_limit); it cannot be resumed from, trying the one before it",
                path,
            )
            continue
        try:
            valid_checkpoint(path)
            return path
        except CheckpointDamagedError as err:
            aside = path.with_name(f"{path.name}.damaged-{uuid.uuid4().hex[:8]}")
            os.rename(path, aside)
            logger.warning(
                "warning: checkpoint %s is damaged (%s %s); set aside as %s, resuming from the one "
                "before it",
                path,
                err.path.name,
                err.detail,
                aside.name,
            )
    return None


def load_training_state(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(optimizer tensors, trainer state) of a committed checkpoint, whole."""
    return load_optimizer_rows(path), json.loads((path / TRAINER_STATE).read_text())


def optimizer_parts(path: Path) -> list[Path]:
    """The checkpoint's optimizer files in rank order (one when one process trained)."""
    if (path / OPTIMIZER_FILE).exists():
        return [path / OPTIMIZER_FILE]
    found = {}
    for file in path.glob("optimizer-rank*-of-*.safetensors"):
        match = _OPTIMIZER_PART.fullmatch(file.name)
        if match:
            found[int(match[1])] = (int(match[2]), file)
    worlds = {world for world, _ in found.values()}
    if len(worlds) != 1 or sorted(found) != list(range(next(iter(worlds)))):
        raise FileNotFoundError(
            f"checkpoint {path} has no complete optimizer state (found {sorted(p.name for _, p in found.values())}); "
            "resume from an earlier checkpoint"
        )
    return [found[r][1] for r in sorted(found)]


def load_optimizer_rows(
    path: Path, rows: Callable[[str, int], tuple[int, int]] | None = None
) -> dict[str, torch.Tensor]:
    """The optimizer tensors of a committed checkpoint, each row tensor cut to `rows(key,
    dim0)` = (start, end) of its dim 0 (default: all rows), read from whichever rank files hold
    them (only those rows are read)."""
    with contextlib.ExitStack() as stack:
        handles = [
            stack.enter_context(safe_open(str(p), framework="pt")) for p in optimizer_parts(path)
        ]
        return _optimizer_rows(handles, rows)


def _optimizer_rows(handles, rows) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key in handles[0].keys():  # noqa: SIM118 (a safetensors handle is not a dict)
        if key.startswith(_SCALAR_PREFIXES):
            out[key] = handles[0].get_tensor(key)
            continue
        sizes = [h.get_slice(key).get_shape()[0] for h in handles]
        dim0 = sum(sizes)
        start, end = (0, dim0) if rows is None else rows(key, dim0)
        pieces, offset = [], 0
        for handle, size in zip(handles, sizes, strict=True):
            lo, hi = max(start, offset), min(end, offset + size)
            if hi > lo:
                pieces.append(handle.get_slice(key)[lo - offset : hi - offset])
            offset += size
        if not pieces:
            # No rows here (a parameter with fewer rows than ranks): an empty tensor of the
            # right dtype and trailing shape.
            pieces = [handles[0].get_slice(key)[0:0]]
        out[key] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out


def policy_version_of(path: Path) -> int:
    return int(path.name.removeprefix("v"))


def retain_checkpoints(
    storage: StorageConfig, run_id: str, *, keep_latest: int, also_keep: frozenset[int]
) -> list[Path]:
    """Delete the run's committed checkpoints but the latest `keep_latest` and the versions in
    `also_keep`, and the optimizer state of every kept one but the latest (a resume starts from
    the latest; the others stay loadable by `from_pretrained`). Returns the deleted folders.

    A folder is renamed to a `.tmp-` name before it is deleted, so a crash midway leaves nothing
    that `latest_checkpoint` reads as committed."""
    found = committed_checkpoints(storage, run_id)
    kept = found[-keep_latest:]
    removed = []
    for path in found:
        if path in kept or policy_version_of(path) in also_keep:
            if path != found[-1]:
                _strip_optimizer_state(path)
            continue
        doomed = path.with_name(f"{path.name}.tmp-removed-{uuid.uuid4().hex[:8]}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed
