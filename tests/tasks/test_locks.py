"""The crash-safe lock manager behind SERIALIZABLE shard caching."""

from __future__ import annotations

import contextvars
import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from prefect.settings import PREFECT_HOME, temporary_settings

from longstraw.storage.holders import current_holder, heartbeats
from longstraw.storage.lockfiles import create_lock_file, lock_file_content, read_lock_file
from longstraw.tasks.locks import CrashSafeFileLockManager


@pytest.fixture()
def manager(tmp_path):
    with temporary_settings({PREFECT_HOME: str(tmp_path)}):
        yield CrashSafeFileLockManager()


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

    # Each thread in the fixture's settings (a new thread starts from the process's own, whose
    # PREFECT_HOME other tests share): the winner's lock stays in this test's folder.
    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(contend, f"h{i}"))
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(winners) == 1


_HOLD_IN_CHILD = """
import sys, time
from longstraw.tasks.locks import CrashSafeFileLockManager
assert CrashSafeFileLockManager().acquire_lock("shard", "child-holder")
print("held", flush=True)
time.sleep(600)
"""


def _start_holder(tmp_path):
    env = os.environ | {"PREFECT_HOME": str(tmp_path), "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD_IN_CHILD], env=env, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_lock_names_its_holder(manager, tmp_path):
    assert manager.acquire_lock("k", "a")
    info = read_lock_file(tmp_path / "longstraw-locks" / "k.lock")
    assert info.holder_name == "a"
    assert info.owner.pid == os.getpid()
    assert info.owner.host == socket.gethostname()
    assert abs(info.owner.process_started_at - psutil.Process().create_time()) < 1
    assert f"pid {os.getpid()}" in info.describe()


@pytest.mark.processes
def test_the_lock_of_a_killed_process_is_taken_over_at_once(tmp_path, capsys):
    with temporary_settings({PREFECT_HOME: str(tmp_path)}):
        manager = CrashSafeFileLockManager(first_report_s=0.1, report_every_s=10)
        child = _start_holder(tmp_path)
        try:
            assert manager.is_locked("shard"), "the live child's lock must hold"
            assert not manager.acquire_lock("shard", "b", acquire_timeout=0.5)
        finally:
            child.kill()  # SIGKILL: no cleanup in the child
            child.wait()
        # The waiting acquirer said what it waits for.
        err = capsys.readouterr().err
        assert "waiting" in err and "'shard'" in err and f"pid {child.pid}" in err, err
        assert "heartbeat" in err
        lock = tmp_path / "longstraw-locks" / "shard.lock"
        assert lock.exists(), "kill -9 leaves the lock file behind"
        # No waiting: the holder's pid is dead, so the first look already frees it.
        assert not manager.is_locked("shard")
        assert manager.acquire_lock("shard", "b", acquire_timeout=0.3)
        assert read_lock_file(lock).holder_name == "b"


def _foreign_lock(directory, heartbeat_age_s):
    """A lock held by a process on another host whose last heartbeat is this old."""
    owner = current_holder().model_copy(update={"host": "elsewhere", "pid": 1})
    path = directory / "longstraw-locks" / "k.lock"
    assert create_lock_file(path, lock_file_content("remote", owner, None))
    stamp = time.time() - heartbeat_age_s
    os.utime(path, (stamp, stamp))
    return path


def test_a_lock_held_elsewhere_lives_as_long_as_its_heartbeat(manager, tmp_path):
    _foreign_lock(tmp_path, heartbeat_age_s=5)
    assert manager.is_locked("k")
    assert not manager.acquire_lock("k", "b", acquire_timeout=0.2)
    _foreign_lock_path = tmp_path / "longstraw-locks" / "k.lock"
    stamp = time.time() - 61  # past the 60 s lease
    os.utime(_foreign_lock_path, (stamp, stamp))
    assert manager.acquire_lock("k", "b", acquire_timeout=0.2)


def test_a_reused_pid_does_not_hold_the_lock(manager, tmp_path):
    me = current_holder()
    older = me.model_copy(update={"process_started_at": me.process_started_at - 100})
    path = tmp_path / "longstraw-locks" / "k.lock"
    assert create_lock_file(path, lock_file_content("gone", older, None))
    info = read_lock_file(path)
    assert "another process" in info.stale_reason()
    assert manager.acquire_lock("k", "b", acquire_timeout=0.2)


def test_the_heartbeat_refreshes_a_held_lock(manager, tmp_path, monkeypatch):
    monkeypatch.setattr(heartbeats, "interval_s", 0.05)
    assert manager.acquire_lock("k", "a")
    path = tmp_path / "longstraw-locks" / "k.lock"
    stamp = time.time() - 1000
    os.utime(path, (stamp, stamp))
    deadline = time.monotonic() + 10
    while path.stat().st_mtime < stamp + 500 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.stat().st_mtime > stamp + 500, "no heartbeat"
    manager.release_lock("k", "a")
    assert not path.exists()


def test_gc_lists_and_removes_only_stale_locks(manager, tmp_path):
    from typer.testing import CliRunner

    from longstraw.storage.gc import collect_stale_locks
    from longstraw.storage.state_commands import state_app

    assert manager.acquire_lock("live", "a")
    _foreign_lock(tmp_path, heartbeat_age_s=120)
    locks = tmp_path / "longstraw-locks"
    args = ["gc", str(tmp_path / "store"), "--locks-dir", str(locks)]
    planned = collect_stale_locks(locks, dry_run=True)
    assert [a.uri for a in planned] == [str(locks / "k.lock")]
    assert "no heartbeat from elsewhere" in planned[0].reason
    result = CliRunner().invoke(state_app, [*args, "--dry-run"])
    assert result.exit_code == 0 and "would remove (1)" in result.output, result.output
    assert (locks / "k.lock").exists()
    result = CliRunner().invoke(state_app, args)
    assert result.exit_code == 0, result.output
    assert not (locks / "k.lock").exists()
    assert (locks / "live.lock").exists()
