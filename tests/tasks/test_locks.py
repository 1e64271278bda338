"""The crash-safe lock manager behind SERIALIZABLE shard caching."""

from __future__ import annotations

import threading
import time

import pytest
from prefect.settings import PREFECT_HOME, temporary_settings

from longstraw.tasks.locks import CrashSafeFileLockManager


@pytest.fixture()
def manager(tmp_path):
    with temporary_settings({PREFECT_HOME: str(tmp_path)}):
        yield CrashSafeFileLockManager(default_hold_timeout_s=60)


def test_locks_live_under_the_current_prefect_home(manager, tmp_path):
    assert manager.acquire_lock("k", "a")
    assert (tmp_path / "longstraw-locks" / "k.lock").exists()
    manager.release_lock("k", "a")
    assert not (tmp_path / "longstraw-locks" / "k.lock").exists()


def test_a_second_holder_waits_until_release(manager):
    assert manager.acquire_lock("k", "a")
    assert not manager.acquire_lock("k", "b", acquire_timeout=0.3)
    released = threading.Timer(0.3, manager.release_lock, args=("k", "a"))
    released.start()
    started = time.monotonic()
    assert manager.acquire_lock("k", "b", acquire_timeout=5)
    assert time.monotonic() - started >= 0.2
    assert manager.is_lock_holder("k", "b")


def test_an_empty_lock_file_left_by_a_crash_is_stale(manager):
    manager._ensure_lock_files_directory_exists()
    (manager.lock_files_directory / "k.lock").write_bytes(b"")
    assert manager.acquire_lock("k", "a", acquire_timeout=1)
    assert manager.is_lock_holder("k", "a")


def test_a_crashed_holders_lock_expires(tmp_path):
    with temporary_settings({PREFECT_HOME: str(tmp_path)}):
        crashed = CrashSafeFileLockManager(default_hold_timeout_s=0.2)
        assert crashed.acquire_lock("k", "dead")  # never released
        survivor = CrashSafeFileLockManager()
        assert survivor.acquire_lock("k", "alive", acquire_timeout=5)
        assert survivor.is_lock_holder("k", "alive")


def test_racing_acquirers_never_read_a_half_written_lock(manager):
    errors, winners = [], []

    def contend(name):
        try:
            if manager.acquire_lock("race", name, acquire_timeout=0.05):
                winners.append(name)
        except Exception as error:  # the stock manager raised "EOF while parsing" here
            errors.append(error)

    threads = [threading.Thread(target=contend, args=(f"h{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(winners) == 1
