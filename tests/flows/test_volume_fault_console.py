"""`OncePerVolumeFault` on its own: one record per volume fault, and a faulted logger's later
failures (its retries of the refused write) kept off the console."""

from __future__ import annotations

import logging
import sys

from longstraw.flows.console import OncePerVolumeFault


def record(name: str, message: str, error: Exception | None = None) -> logging.LogRecord:
    exc_info = None
    if error is not None:
        try:
            raise error
        except Exception:
            exc_info = sys.exc_info()
    return logging.LogRecord(name, logging.ERROR, __file__, 1, message, (), exc_info)


def test_the_first_record_of_a_fault_passes_and_its_repeats_do_not():
    quiet = OncePerVolumeFault()
    full = OSError(28, "No space left on device")
    assert quiet.filter(record("prefect.results", "Failed to write result", full))
    assert not quiet.filter(record("prefect.results", "Failed to write result", full))
    assert not quiet.filter(record("prefect.other", "write failed", full))


def test_a_faulted_loggers_retry_failure_is_dropped_but_other_loggers_errors_pass():
    quiet = OncePerVolumeFault(short=True)
    persister = "prefect.server.events.storage"
    first = record(persister, "Error flushing 1 events", RuntimeError("database or disk is full"))
    assert quiet.filter(first)
    assert first.exc_info is None and "database or disk is full" in first.getMessage()
    retry = RuntimeError("NOT NULL constraint failed: events.occurred")
    assert not quiet.filter(record(persister, "Error flushing 1 events", retry))
    # An unrelated logger's failure, and the faulted logger's plain warnings, still show.
    assert quiet.filter(record("prefect.flow_runs", "boom", ValueError("a bug")))
    assert quiet.filter(record(persister, "events dropped"))


def test_a_failure_before_any_volume_fault_passes():
    quiet = OncePerVolumeFault()
    persister = "prefect.server.events.storage"
    assert quiet.filter(record(persister, "Error flushing", RuntimeError("constraint failed")))
