"""A file lock manager for Prefect's SERIALIZABLE caching that survives crashes and races.

Prefect 3.9's `FileSystemLockManager` creates a lock file empty and writes its content after, so
a concurrent acquirer can read an empty file and fail ("EOF while parsing"); its locks never
expire unless the caller passes a hold timeout, so a process killed while holding one (the crash
LongStraw's resume is built for) would block every later run of the same shard; and its
directory is fixed when the task is defined. This subclass creates each lock file with its
content in one atomic step (hard link of a fully written temp file), gives every lock a default
expiry, treats an unreadable lock file as stale, and keeps its files under the *current*
PREFECT_HOME, so runs and tests with their own home never share locks.
"""

from __future__ import annotations

import datetime
import os
import uuid
from pathlib import Path

import pydantic_core
from prefect.locking.filesystem import FileSystemLockManager
from prefect.settings import PREFECT_HOME

# Longer than any single prefill shard task should take; a crashed holder's lock expires then.
DEFAULT_HOLD_TIMEOUT_S = 3600.0


class CrashSafeFileLockManager(FileSystemLockManager):
    def __init__(self, default_hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S):
        self.default_hold_timeout_s = default_hold_timeout_s
        self._locks = {}

    @property
    def lock_files_directory(self) -> Path:
        return Path(PREFECT_HOME.value()).expanduser().resolve() / "longstraw-locks"

    @lock_files_directory.setter
    def lock_files_directory(self, value: Path) -> None:  # the base __init__ assigns it
        pass

    def _get_lock_info(self, key: str, use_cache: bool = True):
        try:
            return super()._get_lock_info(key, use_cache=use_cache)
        except ValueError:
            # Unreadable content (a lock written by a crashed non-atomic writer): stale.
            self._lock_path_for_key(key).unlink(missing_ok=True)
            self._locks.pop(key, None)
            return None

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        try:
            return super().is_locked(key, use_cache=use_cache)
        except FileNotFoundError:  # an expired lock removed by someone else meanwhile
            self._locks.pop(key, None)
            return False

    def acquire_lock(
        self,
        key: str,
        holder: str,
        acquire_timeout: float | None = None,
        hold_timeout: float | None = None,
    ) -> bool:
        hold = self.default_hold_timeout_s if hold_timeout is None else hold_timeout
        self._ensure_lock_files_directory_exists()
        lock_path = self._lock_path_for_key(key)
        while True:
            held_by_other = self.is_locked(key) and not self.is_lock_holder(key, holder)
            if held_by_other and not self.wait_for_lock(key, acquire_timeout):
                return False
            expiration = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=hold)
            tmp = lock_path.with_name(f"{lock_path.name}.{uuid.uuid4().hex}.tmp")
            tmp.write_bytes(
                pydantic_core.to_json({"holder": holder, "expiration": str(expiration)})
            )
            try:
                os.link(tmp, lock_path)
            except FileExistsError:
                if self.is_lock_holder(key, holder):
                    break
                continue  # someone else won the race: wait for them
            finally:
                tmp.unlink(missing_ok=True)
            break
        self._locks[key] = {"holder": holder, "expiration": expiration, "path": lock_path}
        return True

    async def aacquire_lock(
        self,
        key: str,
        holder: str,
        acquire_timeout: float | None = None,
        hold_timeout: float | None = None,
    ) -> bool:
        return self.acquire_lock(key, holder, acquire_timeout, hold_timeout)
