"""Errors a user can fix: the CLI prints them as one line (`error: <what> — <fix>`), exit 2.

Anything else is a bug or an environment fault and keeps its traceback. `UserError` is a
ValueError so callers that catch bad input as ValueError keep working.
"""

from __future__ import annotations

from collections.abc import Iterator


class UserError(ValueError):
    """Bad input or a refused operation; the message says what is wrong and what to do."""

    def one_line(self) -> str:
        return " ".join(str(self).split())


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then what it was raised from or while handling (`__cause__`, else `__context__`),
    and so on: each exception once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
