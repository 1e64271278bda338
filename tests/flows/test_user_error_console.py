"""`longstraw train` prints a user error once, as one line: Prefect's console copies of it (the
failed task run, each flow run around it, with tracebacks) are hidden, anything else is not."""

from __future__ import annotations

import io
import logging

import pytest

from longstraw.flows.console import HideUserErrors, hide_user_errors_on_console
from longstraw.grpo.rewards import RewardError

pytestmark = pytest.mark.processes


def _console_handlers():
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger()] + [
        logger
        for logger in logging.Logger.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]
    return [h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)]


def test_prefect_console_hides_a_user_error_and_keeps_a_bug(prefect_harness):
    from prefect import flow, task

    @task(retries=1, retry_delay_seconds=0)
    def score_rewards():
        raise RewardError("reward function 'r' returned nan for sample 0 — fix the reward")

    @task
    def buggy_stage():
        raise KeyError("a bug")

    @flow
    def inner(user_error: bool):
        return score_rewards() if user_error else buggy_stage()

    @flow
    def outer(user_error: bool):
        return inner(user_error)

    handlers = _console_handlers()
    assert handlers, "Prefect's logging is not configured: nothing to filter"
    console = io.StringIO()
    # The handler prints through a rich Console bound to its stream when it was made.
    streams = [h.console.file for h in handlers]
    for handler in handlers:
        handler.console.file = console
    try:
        hide_user_errors_on_console()
        hide_user_errors_on_console()  # idempotent: one filter per handler
        assert all(sum(isinstance(f, HideUserErrors) for f in h.filters) == 1 for h in handlers)
        with pytest.raises(RewardError):
            outer(True)
        user_error_output = console.getvalue()
        with pytest.raises(KeyError):
            outer(False)
        bug_output = console.getvalue()[len(user_error_output) :]
    finally:
        for handler, stream in zip(handlers, streams, strict=True):
            handler.console.file = stream
            for f in [f for f in handler.filters if isinstance(f, HideUserErrors)]:
                handler.removeFilter(f)
    assert "RewardError" not in user_error_output and "Traceback" not in user_error_output, (
        user_error_output
    )
    # The same flows failing on a bug still print Prefect's records and the traceback.
    assert "Finished in state Failed" in bug_output and "KeyError" in bug_output, bug_output
    assert "Traceback" in bug_output, bug_output
