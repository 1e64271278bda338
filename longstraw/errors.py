"""Errors a user can fix: the CLI prints them as one line (`error: <what> — <fix>`), exit 2.

Anything else is a bug or an environment fault and keeps its traceback. `UserError` is a
ValueError so callers that catch bad input as ValueError keep working.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input or a refused operation; the message says what is wrong and what to do."""

    def one_line(self) -> str:
        return " ".join(str(self).split())
