"""One writer per run: a lease on `<run dir>/RUN.lock` held while a run trains.

The lock file names its holder (host, pid namespace, pid, process start time; storage.holders) and
its modification time is the holder's heartbeat. A second writer of the same run id and root is
refused with one line naming the holder; the lease of a holder that is gone is taken over at once
on the same host (pid dead or reused) and after `lease_s` without heartbeat elsewhere.

`run_lease(config)` is re-entrant within a process: `longstraw train` takes it before Prefect
starts and the train flow / loop take it again around their steps, both through this helper.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from longstraw.errors import UserError
from longstraw.schemas.run import RunConfig
from longstraw.storage.checkpoints import run_dir
from longstraw.storage.holders import DEFAULT_LEASE_S, current_holder, heartbeats
from longstraw.storage.lockfiles import (
    LockFileInfo,
    create_lock_file,
    lock_file_content,
    read_lock_file,
    remove_if_unchanged,
    touch_if_owned,
)

LEASE_FILE = "RUN.lock"

logger = logging.getLogger("longstraw.lease")

_held: dict[Path, int] = {}
# What this process wrote into each lease it holds: only a file still holding it is removed.
_contents: dict[Path, bytes] = {}
_held_lock = threading.Lock()


class RunLeaseHeld(UserError):
    """Another live process is training this run."""

    def __init__(self, config: RunConfig, info: LockFileInfo):
        who = info.owner.describe() if info.owner else (info.holder_name or "an unknown holder")
        since = time.strftime(
            "%Y-%m-%d %H:%M:%S",
            time.localtime(info.owner.acquired_at if info.owner else info.heartbeat_at),
        )
        super().__init__(
            f"run {config.run_id!r} is already being trained by {who} since {since} "
            f"(lease {info.path}, last heartbeat {time.time() - info.heartbeat_at:.0f} s ago) — "
            f"wait for it to finish or stop it (kill {info.owner.pid if info.owner else '<pid>'}), "
            "or choose another --run-id; a dead holder's lease is taken over automatically"
        )
        self.info = info


def lease_path(config: RunConfig) -> Path:
    return run_dir(config.storage, config.run_id) / LEASE_FILE


def live_lease(path: Path, *, lease_s: float = DEFAULT_LEASE_S) -> LockFileInfo | None:
    """The lease at `path` if its holder may be alive; a stale one is removed (taken over)."""
    while (info := read_lock_file(path)) is not None:
        reason = info.stale_reason(lease_s=lease_s)
        if reason is None:
            return info
        if remove_if_unchanged(path, info.content):
            logger.warning("took over %s: %s", info.describe(), reason)
    return None


def check_run_lease(config: RunConfig, *, lease_s: float = DEFAULT_LEASE_S) -> None:
    """Raise RunLeaseHeld when another process holds the run's lease (this process may)."""
    path = lease_path(config)
    with _held_lock:
        if path in _held:
            return
    info = live_lease(path, lease_s=lease_s)
    if info is not None:
        raise RunLeaseHeld(config, info)


@contextlib.contextmanager
def run_lease(config: RunConfig, *, lease_s: float = DEFAULT_LEASE_S) -> Iterator[Path]:
    """Hold the run's lease for the duration of the block (refused: RunLeaseHeld)."""
    path = lease_path(config)
    with _held_lock:
        if path in _held:
            _held[path] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield path
        finally:
            with _held_lock:
                _held[path] -= 1
        return
    owner = current_holder()
    content = lock_file_content(f"run {config.run_id}", owner, None)
    while not create_lock_file(path, content):
        info = live_lease(path, lease_s=lease_s)
        if info is not None:
            raise RunLeaseHeld(config, info)
    with _held_lock:
        _held[path] = 1
        _contents[path] = content
    heartbeats.register(str(path), lambda: touch_if_owned(path, owner.token))
    try:
        yield path
    except BaseException as failure:
        _release(path, content, lease_s, failure)
        raise
    _release(path, content, lease_s, None)


def _release(path: Path, content: bytes, lease_s: float, failure: BaseException | None) -> None:
    """Remove the lease. One that cannot be removed (the volume turned read-only, or is full and
    the removal's rename fails) is harmless — this process is gone when the next run looks — but
    it is said, with how to remove it: as a note of the error that ends the run, or a warning."""
    heartbeats.unregister(str(path))
    with _held_lock:
        _held.pop(path, None)
        _contents.pop(path, None)
    try:
        remove_if_unchanged(path, content)
    except OSError as err:
        note = (
            f"its lease {path} could not be removed ({err.strerror or err}): the next run on "
            f"this host takes it over at once (on another host {lease_s:.0f} s after its last "
            f"heartbeat), or remove it once the volume is writable: rm {path}"
        )
        if failure is not None:
            failure.add_note(note)
        else:
            logger.warning("warning: %s", note)


def abandon_held_leases() -> None:
    """Remove every lease this process holds, from any thread, without waiting for the blocks
    that hold them: for a process about to exit at once (the interrupt's watchdog). A lease
    that cannot be removed is left to be taken over."""
    with _held_lock:
        held = list(_contents.items())
        _held.clear()
        _contents.clear()
    for path, content in held:
        heartbeats.unregister(str(path))
        with contextlib.suppress(OSError):
            remove_if_unchanged(path, content)
