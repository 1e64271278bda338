"""What Prefect prints on the terminal of `longstraw train` when a user error ends a run.

A `UserError` raised inside a task (a reward that returns NaN, a damaged checkpoint) reaches
`longstraw train`, which prints it as one `error:` line. On its way Prefect logs it three times,
two of them with a full traceback (the task run, each flow run around it): hundreds of lines
before the one that says what to do. `hide_user_errors_on_console()` drops exactly those
records from Prefect's console handlers; the API handler still sends them to the Prefect server,
so the UI keeps every traceback, and `longstraw train --debug` shows them on the terminal.
"""

from __future__ import annotations

import logging

from longstraw.errors import UserError


def _user_error_names() -> set[str]:
    names, todo = set(), [UserError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _chain_has_user_error(exc: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class HideUserErrors(logging.Filter):
    """Drop the records of a run that failed with a UserError: those that carry it as their
    exception, and a task run's "Finished in state Failed(... <UserError subclass>: ...)"."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and _chain_has_user_error(record.exc_info[1]):
            return False
        if record.levelno >= logging.ERROR and record.name.startswith("prefect"):
            message = record.getMessage()
            if message.startswith("Finished in state Failed(") or message.startswith(
                "Task run failed with exception"
            ):
                # Prefect names the exception by its class only ("... exception RewardError: ").
                return not any(f"exception {name}:" in message for name in _user_error_names())
        return True


def hide_user_errors_on_console() -> HideUserErrors:
    """Add the filter to every Prefect console handler (idempotent); returns it."""
    from prefect.logging.handlers import PrefectConsoleHandler

    quiet = HideUserErrors()
    loggers = [logging.getLogger()] + [
        logger
        for logger in logging.Logger.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not any(
                isinstance(f, HideUserErrors) for f in handler.filters
            ):
                handler.addFilter(quiet)
    return quiet
