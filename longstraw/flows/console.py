"""What Prefect prints on the terminal of `longstraw train` when a user error ends a run.

A `UserError` raised inside a task (a reward that returns NaN, a damaged checkpoint) reaches
`longstraw train`, which prints it as one `error:` line. On its way Prefect logs it three times,
two of them with a full traceback (the task run, each flow run around it): hundreds of lines
before the one that says what to do. `hide_user_errors_on_console()` drops exactly those
records from Prefect's console handlers; the API handler still sends them to the Prefect server,
so the UI keeps every traceback, and `longstraw train --debug` shows them on the terminal.

A full or read-only volume fails Prefect too when it holds the Prefect home (the embedded
default keeps it beside the run's storage, `./.longstraw/prefect`): every result write, every
log batch and every database write of the server then fails with a traceback, thousands of
lines before the run's one. `OncePerVolumeFault` lets the first record of each such fault through
and drops its repeats (on the server, without the traceback: `flows.embedded_server`).

A signal that lands in Prefect's task engine before its task run is recorded comes out of the
engine's crash handler as "Task run is not set" (in place of Prefect's `TerminationSignal` for a
SIGTERM, of the KeyboardInterrupt `longstraw train` raises for a SIGINT), and each flow run
around it logs that with its traceback; `longstraw train` ends such a run as the interrupt it
was, with its one resume line. `HideReplacedInterrupts` drops those records from the console
(the server keeps them).
"""

from __future__ import annotations

import logging
from typing import TypeVar

from longstraw.errors import UserError, exception_chain

_Filter = TypeVar("_Filter", bound=logging.Filter)


def _user_error_names() -> set[str]:
    names, todo = set(), [UserError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _chain_has_user_error(exc: BaseException | None) -> bool:
    return any(isinstance(error, UserError) for error in exception_chain(exc))


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

    consoles = [h for h in all_handlers() if isinstance(h, PrefectConsoleHandler)]
    quiet = add_once(consoles, HideUserErrors())
    quiet_volume_faults(consoles)
    return quiet


class HideReplacedInterrupts(logging.Filter):
    """Drop the records whose exception chain holds an interrupt: Prefect's `TerminationSignal`
    or a KeyboardInterrupt. Prefect logs an interrupt that reaches it as a crash, one line with
    no exception attached, so only an error that replaced one carries it."""

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.exceptions import TerminationSignal

        exc = record.exc_info[1] if record.exc_info else None
        return not any(
            isinstance(error, TerminationSignal | KeyboardInterrupt)
            for error in exception_chain(exc)
        )


def hide_replaced_interrupts_on_console() -> HideReplacedInterrupts:
    """Add the filter to every Prefect console handler (idempotent); returns it."""
    from prefect.logging.handlers import PrefectConsoleHandler

    consoles = [h for h in all_handlers() if isinstance(h, PrefectConsoleHandler)]
    return add_once(consoles, HideReplacedInterrupts())


# What a full, read-only or failing volume looks like in Prefect's records (results, SQLite).
VOLUME_FAULT_TEXTS = (
    "No space left on device",
    "database or disk is full",
    "Read-only file system",
    "attempt to write a readonly database",
    "disk I/O error",
)


def volume_fault_text(record: logging.LogRecord) -> str | None:
    """The VOLUME_FAULT_TEXTS phrase in the record's message or exception chain, if any."""
    exc = record.exc_info[1] if record.exc_info else None
    texts = [record.getMessage(), *(str(error) for error in exception_chain(exc))]
    for phrase in VOLUME_FAULT_TEXTS:
        if any(phrase in text for text in texts):
            return phrase
    return None


class OncePerVolumeFault(logging.Filter):
    """Pass the first record of each volume fault (`short`: without its traceback, its
    exception's last line appended), drop the records that repeat it, and drop the failures
    with a traceback that a logger which reported a fault logs after it: its retries of the
    write the full volume refused (Prefect's event persister re-inserts a batch whose rows the
    failed commit emptied and logs an IntegrityError traceback that names no volume)."""

    def __init__(self, short: bool = False):
        super().__init__()
        self.short = short
        self.seen: set[str] = set()
        self.faulted_loggers: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if (phrase := volume_fault_text(record)) is None:
            return not (record.exc_info and record.name in self.faulted_loggers)
        self.faulted_loggers.add(record.name)
        if phrase in self.seen:
            return False
        self.seen.add(phrase)
        if self.short and record.exc_info:
            last = (str(record.exc_info[1]).strip().splitlines() or [""])[0]
            record.msg, record.args = f"{record.getMessage()}: {last}", ()
            record.exc_info, record.exc_text = None, None
        return True


def quiet_volume_faults(handlers, short: bool = False) -> None:
    """Add one OncePerVolumeFault to each handler (idempotent)."""
    add_once(handlers, OncePerVolumeFault(short))


def add_once(handlers, quiet: _Filter) -> _Filter:
    """Add `quiet` to each handler that has no filter of its class yet; returns it."""
    for handler in handlers:
        if not any(isinstance(f, type(quiet)) for f in handler.filters):
            handler.addFilter(quiet)
    return quiet


def all_handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger()] + [
        logger
        for logger in logging.Logger.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]
    return [handler for logger in loggers for handler in logger.handlers]
