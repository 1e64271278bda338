"""Who holds a lock or a lease, whether that holder is gone, and the heartbeat that proves it is not.

A holder is a process: (host, pid namespace, pid, the process's start time) plus a random token
that names one acquisition. Its heartbeat is the modification time of the file or object it holds,
refreshed by one daemon thread per process while held. A holder is gone when
- on this host (same host name and pid namespace): its pid is dead, or the pid now belongs to a
  process started at another time (the pid was reused) — known at once, no waiting;
- elsewhere: its heartbeat is older than the lease (a machine that stops heartbeating for
  `lease_s` is presumed dead or preempted).
Containers on one machine have their own pid namespaces: they count as other hosts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import psutil
from pydantic import BaseModel, ConfigDict

# A holder elsewhere whose heartbeat is this old is presumed dead. Six heartbeats: a loaded
# machine or a slow object store can miss a few without losing what it holds.
DEFAULT_LEASE_S = 60.0
HEARTBEAT_S = 10.0
# Start times are floats derived from boot time + clock ticks; the same process reads the same
# value to well under a second, a reused pid starts later than that.
_START_TIME_TOLERANCE_S = 1.0


class Holder(BaseModel):
    """The process holding a lock or lease (written into the lock file / lease object)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    host: str
    pid_namespace: str
    """/proc/self/ns/pid's link target on Linux ('' elsewhere): containers differ here."""
    pid: int
    process_started_at: float
    """Seconds since the epoch when process `pid` started (psutil's create_time)."""
    token: str
    """Random per acquisition: tells this acquisition's file from a later one by the same process."""
    acquired_at: float

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.process_started_at))
        return f"pid {self.pid} on {self.host} (process started {started})"

    def same_process(self, other: Holder) -> bool:
        return (
            self.host == other.host
            and self.pid_namespace == other.pid_namespace
            and self.pid == other.pid
            and abs(self.process_started_at - other.process_started_at) < _START_TIME_TOLERANCE_S
        )


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start_time(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), or None when no such process runs."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None  # dead, only waiting to be reaped
        return process.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def current_holder() -> Holder:
    """This process, with a fresh token."""
    pid = os.getpid()
    return Holder(
        host=socket.gethostname(),
        pid_namespace=_pid_namespace(),
        pid=pid,
        process_started_at=process_start_time(pid) or 0.0,
        token=uuid.uuid4().hex,
        acquired_at=time.time(),
    )


def why_gone(
    holder: Holder,
    heartbeat_at: float,
    *,
    lease_s: float = DEFAULT_LEASE_S,
    now: float | None = None,
) -> str | None:
    """The reason `holder` no longer holds what it holds, or None while it may still be alive."""
    now = time.time() if now is None else now
    if holder.host == socket.gethostname() and holder.pid_namespace == _pid_namespace():
        started = process_start_time(holder.pid)
        if started is None:
            return f"pid {holder.pid} on this host is not running"
        if abs(started - holder.process_started_at) >= _START_TIME_TOLERANCE_S:
            return f"pid {holder.pid} on this host is now another process (the holder exited)"
        return None
    age = now - heartbeat_at
    if age > lease_s:
        return f"no heartbeat from {holder.host} for {age:.0f} s (lease {lease_s:.0f} s)"
    return None


class _Heartbeats:
    """One daemon thread per process that calls every registered refresh every HEARTBEAT_S."""

    def __init__(self) -> None:
        self._beats: dict[str, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.interval_s = HEARTBEAT_S

    def register(self, key: str, refresh: Callable[[], None]) -> None:
        with self._lock:
            self._beats[key] = refresh
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="longstraw-heartbeat", daemon=True
                )
                self._thread.start()

    def unregister(self, key: str) -> None:
        with self._lock:
            self._beats.pop(key, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            with self._lock:
                beats = list(self._beats.values())
            for refresh in beats:
                # A missed beat is survivable; the next one retries.
                with contextlib.suppress(Exception):
                    refresh()


heartbeats = _Heartbeats()
