"""Local lock files that name their holder: create, inspect, heartbeat, take over, list the stale.

A lock file is JSON `{"holder": <caller's holder string>, "expiration": <ISO time or null>,
"owner": Holder}` created in one atomic step (hard link of a fully written temp file), so no
reader ever sees it half written. Its modification time is the owner's heartbeat. A lock is stale
when its owner is gone (storage.holders.why_gone), when its expiration has passed, or when it
cannot be parsed (a file left by a writer that was not atomic).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from longstraw.storage.holders import DEFAULT_LEASE_S, Holder, why_gone

LOCK_SUFFIX = ".lock"


@dataclass(frozen=True)
class LockFileInfo:
    path: Path
    content: bytes
    holder_name: str | None
    """The caller's holder string (Prefect: host:pid:thread)."""
    owner: Holder | None
    expiration: datetime.datetime | None
    heartbeat_at: float
    """The file's modification time."""

    @property
    def name(self) -> str:
        return self.path.name.removesuffix(LOCK_SUFFIX)

    def stale_reason(
        self, *, lease_s: float = DEFAULT_LEASE_S, now: float | None = None
    ) -> str | None:
        """Why this lock no longer protects anything, or None while its holder may be alive."""
        now = time.time() if now is None else now
        if self.expiration is not None and self.expiration.timestamp() < now:
            return f"expired at {self.expiration.isoformat(timespec='seconds')}"
        if self.owner is None:
            if self.holder_name is None:
                return "unreadable lock file (left by an interrupted writer)"
            return None  # a lock without owner information: only its expiration frees it
        return why_gone(self.owner, self.heartbeat_at, lease_s=lease_s, now=now)

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        who = self.owner.describe() if self.owner else (self.holder_name or "an unknown holder")
        return (
            f"lock {self.name!r} held by {who}, last heartbeat {now - self.heartbeat_at:.0f} s ago "
            f"({self.path})"
        )


def read_lock_file(path: Path) -> LockFileInfo | None:
    """The lock at `path`, or None when there is none."""
    try:
        content = path.read_bytes()
        heartbeat_at = path.stat().st_mtime
    except FileNotFoundError:
        return None
    return parse_lock(path, content, heartbeat_at)


def parse_lock(path: Path, content: bytes, heartbeat_at: float) -> LockFileInfo:
    """A lock's content read from anywhere (a local file, an object); unparseable: no holder."""
    holder_name = owner = expiration = None
    try:
        raw = json.loads(content)
        holder_name = str(raw["holder"])
        if raw.get("expiration"):
            expiration = datetime.datetime.fromisoformat(raw["expiration"])
        if raw.get("owner") is not None:
            owner = Holder.model_validate(raw["owner"])
    except (ValueError, KeyError, TypeError, ValidationError):
        holder_name = owner = expiration = None
    return LockFileInfo(path, content, holder_name, owner, expiration, heartbeat_at)


def lock_file_content(
    holder_name: str, owner: Holder, expiration: datetime.datetime | None
) -> bytes:
    return json.dumps(
        {
            "holder": holder_name,
            "expiration": expiration.isoformat() if expiration is not None else None,
            "owner": owner.model_dump(mode="json"),
        }
    ).encode()


def create_lock_file(path: Path, content: bytes) -> bool:
    """Create `path` holding `content` unless it exists (atomic). True: created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(content)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def remove_if_unchanged(path: Path, content: bytes) -> bool:
    """Remove the lock at `path` only if it still holds `content` (the lock judged stale).

    Renames it aside first (atomic), so a racing acquirer that created a fresh lock after our
    judgement is put back rather than deleted. True: removed (or already gone).
    """
    aside = path.with_name(f"{path.name}.{uuid.uuid4().hex}.stale")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return True
    try:
        if aside.read_bytes() == content:
            return True
        # A fresh lock: put it back (unless yet another was created meanwhile).
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        return False
    finally:
        aside.unlink(missing_ok=True)


def touch_if_owned(path: Path, token: str) -> None:
    """Heartbeat: refresh the lock's modification time while it is still ours."""
    info = read_lock_file(path)
    if info is not None and info.owner is not None and info.owner.token == token:
        os.utime(path)


def stale_lock_files(
    directory: Path, *, lease_s: float = DEFAULT_LEASE_S
) -> list[tuple[LockFileInfo, str]]:
    """(lock, why stale) for every stale lock file in `directory`."""
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.glob(f"*{LOCK_SUFFIX}")):
        info = read_lock_file(path)
        if info is not None and (reason := info.stale_reason(lease_s=lease_s)) is not None:
            found.append((info, reason))
    return found
