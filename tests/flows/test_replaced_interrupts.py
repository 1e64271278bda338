"""The console filter that keeps a replaced interrupt's tracebacks off `longstraw train`'s
terminal drops exactly the records whose exception chain holds an interrupt (Prefect's
TerminationSignal, a KeyboardInterrupt)."""

from __future__ import annotations

import logging
import sys

from prefect.exceptions import TerminationSignal

from longstraw.flows.console import HideReplacedInterrupts


def _record(exc: BaseException | None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "m", (), exc_info)


def _raised(make) -> BaseException:
    try:
        make()
    except BaseException as exc:  # the test keeps whatever was raised
        return exc
    raise AssertionError("nothing was raised")


def _replaced_by_an_error(interrupt=TerminationSignal(15)):
    try:
        raise interrupt
    except BaseException:
        raise ValueError("Task run is not set")  # noqa: B904 (as Prefect's task engine does)


def _wrapped_again():
    try:
        _replaced_by_an_error()
    except ValueError as exc:
        raise RuntimeError("the flow run failed") from exc


def test_records_of_a_replaced_interrupt_are_dropped_and_others_kept():
    quiet = HideReplacedInterrupts()
    assert not quiet.filter(_record(_raised(_replaced_by_an_error)))
    assert not quiet.filter(_record(_raised(_wrapped_again)))
    assert not quiet.filter(_record(_raised(lambda: _replaced_by_an_error(KeyboardInterrupt()))))
    assert quiet.filter(_record(_raised(lambda: sys.exit("not a signal"))))
    assert quiet.filter(_record(_raised(lambda: {}["a bug"])))
    assert quiet.filter(_record(None))
