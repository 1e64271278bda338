"""Listing and garbage collection of the state key space (plain functions; the CLI wraps them).

gc removes (a) whole policy-version directories older than the newest `keep_versions` of each run,
(b) attempts that no COMMITTED.json references and that nobody touched for the grace period, and
(c) likewise the attempts of sweep checkpoints that no checkpoint marker names (a write killed
midway).
In an uncommitted directory the shard manifests naming such an attempt go first, so a crash in
the middle leaves orphan chunks (harmless, removed next time), never a manifest without chunks.
Reference states are never removed by version (the reference model does not change).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from longstraw.schemas.storage import (
    ShardManifest,
    StateManifest,
    StorageConfig,
    SweepCheckpointManifest,
)
from longstraw.storage.holders import DEFAULT_LEASE_S
from longstraw.storage.lockfiles import remove_if_unchanged, stale_lock_files
from longstraw.storage.paths import (
    ATTEMPT_PREFIX,
    COMMITTED_NAME,
    SHARDS_DIR,
    SWEEPS_DIR,
    filesystem,
    json_number,
)
from longstraw.storage.sweep_checkpoints import SWEEP_CHECKPOINTS_DIR

_POLICY_DIR = re.compile(r"^runs/([^/]+)/policy-v(\d+)/prompts/([^/]+)/(.+)$")
_SWEEP_DIR = re.compile(rf"^runs/([^/]+)/policy-v(\d+)/{SWEEPS_DIR}/([^/]+)/(.+)$")
_REFERENCE_DIR = re.compile(r"^reference/([^/]+)/prompts/([^/]+)/(.+)$")


@dataclass
class AttemptInfo:
    attempt_id: str
    nbytes: int = 0
    newest_mtime: float = 0.0
    """Seconds since the epoch of the attempt's newest object."""
    committed: bool = False
    """Referenced by the directory's COMMITTED.json (holds chunks of the committed state)."""


@dataclass
class StateDirInfo:
    uri: str
    kind: str
    """policy or reference."""
    run_id: str | None
    policy_version: int | None
    weights_digest: str | None
    prompt_digest: str
    committed: bool = False
    num_tokens: int | None = None
    nbytes: int = 0
    shard_manifests: dict[int, str] = field(default_factory=dict)
    """shard index -> path of its manifest."""
    attempts: dict[str, AttemptInfo] = field(default_factory=dict)


def _mtime(info: dict) -> float:
    if "mtime" in info:
        return float(info["mtime"])
    lm = info.get("LastModified") or info.get("last_modified")
    return lm.timestamp() if lm is not None else 0.0


def _count_in_attempt(attempts: dict[str, AttemptInfo], rest: str, size: int, info: dict) -> None:
    """Count an object at `rest` (`attempt-<id>/...` inside its directory) into its attempt."""
    attempt_id = rest[len(ATTEMPT_PREFIX) :].split("/", 1)[0]
    attempt = attempts.setdefault(attempt_id, AttemptInfo(attempt_id))
    attempt.nbytes += size
    attempt.newest_mtime = max(attempt.newest_mtime, _mtime(info))


def _parse(rel: str):
    """(state dir, rest, kind, run_id, version, weights, prompt) of a path under root, or None."""
    if m := _POLICY_DIR.match(rel):
        run_id, version, prompt, rest = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        d_rel = f"runs/{run_id}/policy-v{version}/prompts/{prompt}"
        return d_rel, rest, "policy", run_id, version, None, prompt
    if m := _REFERENCE_DIR.match(rel):
        weights, prompt, rest = m.group(1), m.group(2), m.group(3)
        return (
            f"reference/{weights}/prompts/{prompt}",
            rest,
            "reference",
            None,
            None,
            weights,
            prompt,
        )
    return None


def list_states(root_uri: str, config: StorageConfig | None = None) -> list[StateDirInfo]:
    """Every state directory under root: committed or not, its attempts and their sizes."""
    fs, root = filesystem(root_uri, config)
    root_uri = root_uri if "://" in root_uri else StorageConfig(root_uri=root_uri).root_uri
    fs.invalidate_cache()
    try:
        files = fs.find(root, detail=True)
    except FileNotFoundError:
        return []
    dirs: dict[str, StateDirInfo] = {}
    for path, info in files.items():
        if info.get("type") == "directory":
            continue
        parsed = _parse(path[len(root) :].lstrip("/"))
        if parsed is None:
            continue
        d_rel, rest, kind, run_id, version, weights, prompt = parsed
        if d_rel not in dirs:
            dirs[d_rel] = StateDirInfo(
                f"{root_uri}/{d_rel}", kind, run_id, version, weights, prompt
            )
        d = dirs[d_rel]
        size = int(info.get("size") or 0)
        d.nbytes += size
        if rest == COMMITTED_NAME:
            d.committed = True
        elif rest.startswith(SHARDS_DIR + "/"):
            if (shard := json_number(rest)) is not None:
                d.shard_manifests[shard] = path
        elif rest.startswith(ATTEMPT_PREFIX):
            _count_in_attempt(d.attempts, rest, size, info)
    for d_rel, d in dirs.items():
        if d.committed:
            manifest = StateManifest.model_validate_json(
                fs.cat_file(f"{root}/{d_rel}/{COMMITTED_NAME}")
            )
            d.num_tokens = manifest.num_tokens
            d.weights_digest = manifest.weights_digest
            for s in manifest.shards:
                if s.attempt_id in d.attempts:
                    d.attempts[s.attempt_id].committed = True
    return sorted(dirs.values(), key=lambda d: d.uri)


@dataclass
class SweepDirInfo:
    """The sweep checkpoints of one backward (`storage.sweep_checkpoints`)."""

    uri: str
    run_id: str
    policy_version: int
    group: str
    """g{prompt index}."""
    committed: list[int] = field(default_factory=list)
    """`swept` of each committed checkpoint."""
    nbytes: int = 0
    attempts: dict[str, AttemptInfo] = field(default_factory=dict)


def list_sweeps(root_uri: str, config: StorageConfig | None = None) -> list[SweepDirInfo]:
    """Every backward's sweep checkpoints under root: committed ones and attempts, with sizes."""
    fs, root = filesystem(root_uri, config)
    root_uri = root_uri if "://" in root_uri else StorageConfig(root_uri=root_uri).root_uri
    fs.invalidate_cache()
    try:
        files = fs.find(f"{root}/runs", detail=True)
    except FileNotFoundError:
        return []
    dirs: dict[str, SweepDirInfo] = {}
    markers: list[tuple[SweepDirInfo, str]] = []
    for path, info in files.items():
        m = _SWEEP_DIR.match(path[len(root) :].lstrip("/"))
        if m is None or info.get("type") == "directory":
            continue
        run_id, version, group, rest = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        d_rel = f"runs/{run_id}/policy-v{version}/{SWEEPS_DIR}/{group}"
        d = dirs.setdefault(d_rel, SweepDirInfo(f"{root_uri}/{d_rel}", run_id, version, group))
        size = int(info.get("size") or 0)
        d.nbytes += size
        if rest.startswith(SWEEP_CHECKPOINTS_DIR + "/"):
            if (swept := json_number(rest)) is not None:
                d.committed.append(swept)
                markers.append((d, path))
        elif rest.startswith(ATTEMPT_PREFIX):
            _count_in_attempt(d.attempts, rest, size, info)
    for d, path in markers:
        try:
            attempt_id = SweepCheckpointManifest.model_validate_json(fs.cat_file(path)).attempt_id
        except (ValueError, FileNotFoundError):
            continue  # an unreadable marker names nothing: its attempt is collected too
        if attempt_id in d.attempts:
            d.attempts[attempt_id].committed = True
    for d in dirs.values():
        d.committed.sort()
    return sorted(dirs.values(), key=lambda d: d.uri)


@dataclass(frozen=True)
class GcAction:
    uri: str
    reason: str
    nbytes: int


def collect_garbage(
    root_uri: str,
    *,
    keep_versions: int | None = None,
    grace_seconds: float | None = None,
    dry_run: bool = False,
    config: StorageConfig | None = None,
) -> list[GcAction]:
    """Remove old policy versions and stale uncommitted attempts; returns what was (or would be) removed.

    keep_versions: keep the newest N policy versions of each run (None: keep all versions).
    grace_seconds: leave attempts touched more recently alone (default: the config's grace period).
    """
    if keep_versions is not None and keep_versions < 1:
        raise ValueError(f"keep_versions={keep_versions}: keep at least the newest version (>= 1)")
    config = config or StorageConfig()
    grace = config.uncommitted_grace_seconds if grace_seconds is None else grace_seconds
    fs, _ = filesystem(root_uri, config)
    states = list_states(root_uri, config)
    actions: list[GcAction] = []
    removed_versions: set[tuple[str, int]] = set()
    if keep_versions is not None:
        versions: dict[str, set[int]] = {}
        for d in states:
            if d.kind == "policy":
                versions.setdefault(d.run_id, set()).add(d.policy_version)
        for run_id, vs in versions.items():
            for v in sorted(vs)[:-keep_versions]:
                removed_versions.add((run_id, v))
                version_uri = next(
                    d.uri for d in states if d.run_id == run_id and d.policy_version == v
                )
                version_uri = version_uri.rsplit("/prompts/", 1)[0]
                nbytes = sum(
                    d.nbytes for d in states if d.run_id == run_id and d.policy_version == v
                )
                actions.append(
                    GcAction(
                        version_uri,
                        f"policy version {v} older than the newest {keep_versions}",
                        nbytes,
                    )
                )
    now = time.time()
    for d in states:
        if (d.run_id, d.policy_version) in removed_versions:
            continue
        stale = {
            a.attempt_id
            for a in d.attempts.values()
            if not a.committed and now - a.newest_mtime >= grace
        }
        if not stale:
            continue
        if not d.committed:
            for k, path in sorted(d.shard_manifests.items()):
                m = ShardManifest.model_validate_json(fs.cat_file(path))
                if m.attempt_id in stale:
                    actions.append(
                        GcAction(
                            f"{d.uri}/{SHARDS_DIR}/{k:05d}.json",
                            "shard manifest of a stale attempt",
                            0,
                        )
                    )
        for attempt_id in sorted(stale):
            a = d.attempts[attempt_id]
            actions.append(
                GcAction(
                    f"{d.uri}/{ATTEMPT_PREFIX}{attempt_id}",
                    "uncommitted attempt past the grace period",
                    a.nbytes,
                )
            )
    for d in list_sweeps(root_uri, config):
        if (d.run_id, d.policy_version) in removed_versions:
            continue
        for a in d.attempts.values():
            if not a.committed and now - a.newest_mtime >= grace:
                actions.append(
                    GcAction(
                        f"{d.uri}/{ATTEMPT_PREFIX}{a.attempt_id}",
                        "uncommitted sweep checkpoint past the grace period",
                        a.nbytes,
                    )
                )
    if not dry_run:
        for action in actions:
            afs, path = filesystem(action.uri, config)
            afs.rm(path, recursive=True)
        fs.invalidate_cache()
    return actions


def collect_checkpoint_leftovers(
    config: StorageConfig, *, grace_seconds: float | None = None, dry_run: bool = False
) -> list[GcAction]:
    """Remove the temporary checkpoint directories (`runs/*/checkpoints/v*.tmp-*` under the
    local root) that a process killed mid-write left, once untouched for the grace period (a
    live writer renames its own within seconds). Returns what was (or would be) removed."""
    import shutil

    from longstraw.storage.checkpoints import local_root

    grace = config.uncommitted_grace_seconds if grace_seconds is None else grace_seconds
    now = time.time()
    actions = []
    for tmp in sorted(local_root(config).glob("runs/*/checkpoints/v*.tmp-*")):
        files = [f for f in tmp.rglob("*") if f.is_file()]
        newest = max((f.stat().st_mtime for f in files), default=tmp.stat().st_mtime)
        if now - newest < grace:
            continue
        nbytes = sum(f.stat().st_size for f in files)
        actions.append(GcAction(str(tmp), "checkpoint left half-written by a killed run", nbytes))
        if not dry_run:
            shutil.rmtree(tmp, ignore_errors=True)
    return actions


def default_locks_dir() -> Path:
    """The lock files of Prefect's shard caching: $PREFECT_HOME/longstraw-locks, or the embedded
    default's ./.longstraw/prefect/longstraw-locks."""
    home = os.environ.get("PREFECT_HOME") or "./.longstraw/prefect"
    return Path(home).expanduser().resolve() / "longstraw-locks"


def collect_stale_locks(
    locks_dir: Path, *, lease_s: float = DEFAULT_LEASE_S, dry_run: bool = False
) -> list[GcAction]:
    """Remove lock files whose holder is gone (see storage.holders); returns what was removed.

    A lock whose holder is alive is never touched; one that changed hands since it was judged
    stale is left in place.
    """
    actions = []
    for info, reason in stale_lock_files(locks_dir, lease_s=lease_s):
        if dry_run or remove_if_unchanged(info.path, info.content):
            actions.append(GcAction(str(info.path), f"stale lock: {info.describe()}: {reason}", 0))
    return actions
