"""The lock manager behind Prefect's SERIALIZABLE shard caching: locks that name their holder.

Prefect 3.9's `FileSystemLockManager` creates a lock file empty and writes its content after (a
concurrent acquirer can read an empty file and fail), its locks never expire unless the caller
passes a hold timeout, so a process killed while holding one blocks every later run of the shard
silently, and its directory is fixed when the task is defined. This subclass:
- creates each lock file with its content in one atomic step (storage.lockfiles);
- writes the holder into it (host, pid namespace, pid, process start time, a token) and keeps its
  modification time fresh from a heartbeat thread while held;
- takes a lock over as soon as its holder is gone (this host: pid dead or reused; elsewhere:
  heartbeat older than the lease), and treats an unreadable lock as stale;
- says what a waiting run waits for (lock, holder, heartbeat age) on stderr and in the log,
  after 2 s and then every 30 s, instead of waiting silently;
- keeps its files under the *current* PREFECT_HOME, so runs and tests with their own home never
  share locks.
`longstraw state gc` lists and removes stale lock files (storage.lockfiles.stale_lock_files).
"""

from __future__ import annotations

import datetime
import logging
import sys
import time
from pathlib import Path

from prefect.locking.filesystem import FileSystemLockManager
from prefect.settings import PREFECT_HOME

from longstraw.storage.holders import DEFAULT_LEASE_S, current_holder, heartbeats
from longstraw.storage.lockfiles import (
    create_lock_file,
    lock_file_content,
    read_lock_file,
    remove_if_unchanged,
    touch_if_owned,
)

LOCKS_DIR_NAME = "longstraw-locks"
_POLL_S = 0.1

logger = logging.getLogger("longstraw.locks")


def locks_directory() -> Path:
    """Where lock files of the current PREFECT_HOME live."""
    return Path(PREFECT_HOME.value()).expanduser().resolve() / LOCKS_DIR_NAME


class CrashSafeFileLockManager(FileSystemLockManager):
    def __init__(
        self,
        default_hold_timeout_s: float | None = None,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        first_report_s: float = 2.0,
        report_every_s: float = 30.0,
    ):
        """default_hold_timeout_s: an upper bound on holding a lock even for a live holder
        (None: held for as long as the holder lives). lease_s: how old the heartbeat of a holder
        on another host may get before its lock is taken over."""
        self.default_hold_timeout_s = default_hold_timeout_s
        self.lease_s = lease_s
        self.first_report_s = first_report_s
        self.report_every_s = report_every_s
        self._locks = {}

    @property
    def lock_files_directory(self) -> Path:
        return locks_directory()

    @lock_files_directory.setter
    def lock_files_directory(self, value: Path) -> None:  # the base __init__ assigns it
        pass

    def _lock_path_for_key(self, key: str) -> Path:
        if (held := self._locks.get(key)) is not None:
            # Where it was taken: a release from another thread may see other settings.
            return held["path"]
        return self.lock_files_directory.joinpath(key).with_suffix(".lock")

    def _live_lock(self, key: str):
        """The lock on `key` if its holder may still be alive; a stale one is removed."""
        path = self._lock_path_for_key(key)
        while (info := read_lock_file(path)) is not None:
            reason = info.stale_reason(lease_s=self.lease_s)
            if reason is None:
                return info
            if remove_if_unchanged(path, info.content):
                logger.warning("took over %s: %s", info.describe(), reason)
        return None

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        return self._live_lock(key) is not None

    def is_lock_holder(self, key: str, holder: str) -> bool:
        info = self._live_lock(key)
        return info is not None and info.holder_name == holder

    def acquire_lock(
        self,
        key: str,
        holder: str,
        acquire_timeout: float | None = None,
        hold_timeout: float | None = None,
    ) -> bool:
        hold = self.default_hold_timeout_s if hold_timeout is None else hold_timeout
        path = self._lock_path_for_key(key)
        deadline = None if not acquire_timeout else time.monotonic() + acquire_timeout
        while True:
            info = self._live_lock(key)
            if info is not None and info.holder_name == holder:
                return True  # re-entrant: this holder has it already
            if info is not None:
                remaining = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
                if not self.wait_for_lock(key, remaining):
                    return False
            owner = current_holder()
            expiration = (
                datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=hold)
                if hold is not None
                else None
            )
            if create_lock_file(path, lock_file_content(holder, owner, expiration)):
                break
            # Someone else created it between our check and our link: wait for them.
        self._locks[key] = {"holder": holder, "expiration": expiration, "path": path}
        heartbeats.register(str(path), lambda: touch_if_owned(path, owner.token))
        return True

    async def aacquire_lock(
        self,
        key: str,
        holder: str,
        acquire_timeout: float | None = None,
        hold_timeout: float | None = None,
    ) -> bool:
        return self.acquire_lock(key, holder, acquire_timeout, hold_timeout)

    def release_lock(self, key: str, holder: str) -> None:
        path = self._lock_path_for_key(key)
        info = self._live_lock(key)
        if info is None:
            raise ValueError(f"No lock for transaction with key {key}")
        if info.holder_name != holder:
            raise ValueError(f"No lock held by {holder} for transaction with key {key}")
        heartbeats.unregister(str(path))
        remove_if_unchanged(path, info.content)
        self._locks.pop(key, None)

    def wait_for_lock(self, key: str, timeout: float | None = None) -> bool:
        """Wait until `key` is free (True) or `timeout` seconds pass (False), saying what for."""
        started = time.monotonic()
        next_report = started + self.first_report_s
        while (info := self._live_lock(key)) is not None:
            now = time.monotonic()
            if timeout and now - started >= timeout:
                return False
            if now >= next_report:
                self._report_wait(info, now - started)
                next_report = now + self.report_every_s
            time.sleep(_POLL_S)
        return True

    async def await_for_lock(self, key: str, timeout: float | None = None) -> bool:
        return self.wait_for_lock(key, timeout)

    def _report_wait(self, info, waited_s: float) -> None:
        message = (
            f"waiting {waited_s:.0f} s for {info.describe()}; it is taken over when that process "
            f"exits (or, on another host, {self.lease_s:.0f} s after its last heartbeat)"
        )
        print(message, file=sys.stderr, flush=True)
        logger.warning(message)
